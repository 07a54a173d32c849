"""What the tests of the base at a task's precision share (`test_base_at_task_precision`,
`test_mxfp4_bases`): an input set, the parameters that make each method select, draw or
blend, the agents a method merges, and every method's merge by the independent references
(`reference`, `sparse_reference`, `stock_reference`, `geometric_reference`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import geometric_reference as geo
import sparse_reference as sparse
import stock_reference as stock
import tall_reference as tall
import torch
from reference import reference_merge

from ram_dist.methods.registry import METHODS

F32 = torch.float32
#: The RAM family: the methods whose report has the overlap statistics (`reference_merge`).
RAM_FAMILY = tuple(name for name, m in METHODS.items() if m.reports_overlap)
#: Parameters that make each method select, draw or blend (nuslerp and multislerp: a weight
#: per task, `TASK_WEIGHTS`; the rest their defaults).
PARAMETERS = {
    "ties": {"density": 0.5},
    "dare_linear": {"density": 0.5, "seed": 3},
    "dare_ties": {"density": 0.5, "seed": 3},
    "breadcrumbs": {"density": 0.5, "gamma": 0.05},
    "breadcrumbs_ties": {"density": 0.5, "gamma": 0.05},
    "della": {"density": 0.5, "epsilon": 0.1, "seed": 3},
    "della_linear": {"density": 0.5, "epsilon": 0.1, "seed": 3},
    "sce": {"select_topk": 0.5},
    "nearswap": {"t": 0.001},
    "slerp": {"t": 0.3},
    "consensus_ta": {"k": 2, "lambda": 0.5},
    "consensus_ties": {"density": 0.5, "k": 2, "lambda": 0.5},
}
TASK_WEIGHTS = (0.6, 0.9, 0.7)
WEIGHTED = ("nuslerp", "multislerp")


@dataclass
class InputSet:
    base_dir: Path
    task_dirs: list[Path]
    base: dict  # as stored (FP8 weights with their scales)
    x_base: dict  # x_B: the base's values (FP8 weights dequantized, float32)
    tasks: list[dict]  # as stored (no FP8 task here)
    touched: dict  # per tensor: the elements some agent changed
    block: tuple[int, int] | None
    row_budget: int  # bytes of one row of the widest input (an FP8 weight: one band a unit)
    out_dtype: str | None = None
    epsilon: float = 1e-5  # the RAM family's


def tasks_for(method: str) -> list[int]:
    """The agents a method merges: as many as it takes, changed ones first."""
    most = METHODS[method].task_counts[1]
    return [0, 1, 2][: 3 if most is None else most]


def reference_for(method: str, s: InputSet, picked: list[int]) -> tuple[dict, dict | None]:
    """The references' float32 merged values per tensor (and the RAM family's statistics)."""
    base, tasks = s.x_base, [s.tasks[i] for i in picked]
    params = PARAMETERS.get(method, {})
    weights = [TASK_WEIGHTS[i] for i in range(len(picked))]
    if method in RAM_FAMILY:
        return reference_merge(base, tasks, method, eps=s.epsilon, out_dtype=F32)
    out = {}
    for name, b in base.items():
        ts = [t[name] for t in tasks]
        if method in sparse.METHODS:
            n = len(ts)
            y = sparse.sparse_merge(
                method, b, ts, name=name, weights=[1.0] * n,
                densities=[params.get("density", 1.0)] * n,
                gammas=[params.get("gamma", 0.01)] * n,
                epsilons=[params.get("epsilon", 0.15)] * n, seed=params.get("seed", 0),
            )  # fmt: skip
        elif method in tall.METHODS:
            n = len(ts)
            y = tall.consensus_merge(
                method, b, ts, weights=[1.0] * n, densities=[params.get("density", 1.0)] * n,
                k=params["k"], lambdas=[params["lambda"]] * n,
            )  # fmt: skip
        elif method == "linear":
            y = sparse.linear(ts, [1.0] * len(ts))
        elif method == "model_stock":
            y = stock.model_stock(b, ts)
        elif method == "sce":
            y = stock.sce(b, ts, params["select_topk"])
        elif method == "arcee_fusion":
            y = stock.arcee_fusion(b, ts[0])
        elif method == "nearswap":
            y = stock.nearswap(b, ts[0], params["t"])
        elif method == "passthrough":
            y = stock.passthrough(ts[0])
        elif method == "slerp":
            y = geo.slerp(b, ts[0], params["t"])
        elif method == "nuslerp":
            y = geo.nuslerp(b, ts, weights)
        elif method == "multislerp":
            y = geo.multislerp(b, ts, weights)
        elif method == "karcher":
            y = geo.karcher(ts)
        else:
            raise AssertionError(f"no reference for {method}: add it here and in tests/support")
        out[name] = torch.as_tensor(y).reshape(b.shape).to(F32)
    return out, None
