"""mergekit's `model_stock` (`ModelStock`, listed in `METHODS`; Jang et al. 2024).

Per tensor, with task vectors `d_i = theta_i - theta_B` (float32) of N >= 2 task models:
the mean `c` over pairs i < j of `cos_ij = clamp(<d_i, d_j> / max(|d_i| |d_j|, 1e-6), -1, 1)`,
the ratio `t = N c / (1 + (N - 1) c)` (0 where `|1 + (N - 1) c| < 1e-6`, mergekit's
singularity rule), then per element, in float32,
`t * avg + (1 - t) * theta_B` with `avg = (((0 + theta_1) + theta_2) + ...) / N`.

Computed here:
* whole tensor (default): one reduce round of exact sums (`exact_sums.product_sum`): the
  N squared norms and the N(N-1)/2 dot products of the task vectors. The driver takes the
  cosines, their mean and t once per tensor in float64 (Python `math`), and rounds t to
  float32 once; the map pass is element-wise with that t (`1 - t` in float32, as torch
  computes it), on the CPU by the fused kernel (`blend_numba.stock`, with filter_wise too),
  which reads quantized inputs as stored (`reads_stored`), as the round's sums and
  filter_wise's row sums do (`kernels/vector_sums_numba.py`).
* `filter_wise`: t per row (mergekit's `dim=-1`; a 1-D tensor is one row). The tensor's
  units hold whole rows (`whole_rows`), so each chunk takes its rows' sums itself, exactly
  (`rows.gram_rows` eagerly; on the fused path the records' Gram kernel per row), and each
  row's t in float64 with Python `math`, rounded to float32 once. No reduce round.

mergekit sums in float32 (torch's order) and takes the norms, cosines and t in float32, so
its t may differ from ours by a few float32 ulps; the merged values then differ by at most
that times |avg - theta_B|, within the spec's bound. With the same t the bytes are the same
(the map pass is mergekit's expression op by op).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.methods import exact_sums, rows
from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import Eager, MergekitRule, State, TensorParams
from ram_dist.methods.task_vectors import task_values, task_vectors

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: mergekit's floors: of a norm product, and of |1 + (N - 1) cos| before t is taken as 0.
MIN_NORM_PRODUCT = 1e-6
SINGULAR = 1e-6

FILTER_WISE = Parameter(
    "filter_wise", False, "one ratio t per row instead of per tensor", kind=bool,
    cli_flag="--filter-wise",
)  # fmt: skip


def pairs(n: int) -> list[tuple[int, int]]:
    """The statistics' rows: every (i, j), i <= j (squared norms where i == j), in the order
    of `exact_sums.gram`."""
    return exact_sums.pairs_of(n)


def fused_gram(inputs: Sequence[Any], pairs_: list[tuple[int, int]]) -> np.ndarray | None:
    """The exact sums of `pairs_` of the task vectors of a chunk's inputs (base first, as
    the engine hands them: a quantized one as stored, decoded as the kernel loads it) by
    the numba kernel, bin for bin the eager rule's; None where numba is not installed."""
    from ram_dist import kernels

    kernel = kernels.numba_module("vector_sums_numba")
    if kernel is None:
        return None
    base, *tasks = inputs
    return kernel.gram(base, tasks, kernel.DELTAS, pairs_)[0]


def ratio(sums: Mapping[tuple[int, int], float], n: int) -> float:
    """t from the exact sums of one tensor (or row), in float64, rounded to float32 once."""
    import numpy as np

    cosines = []
    for i in range(n):
        for j in range(i + 1, n):
            norm_product = math.sqrt(sums[i, i]) * math.sqrt(sums[j, j])
            cos = sums[i, j] / max(norm_product, MIN_NORM_PRODUCT)
            cosines.append(cos if cos != cos else min(max(cos, -1.0), 1.0))
    if any(c != c for c in cosines):
        return math.nan
    cos_theta = math.fsum(cosines) / len(cosines)
    denominator = 1 + (n - 1) * cos_theta
    t = 0.0 if abs(denominator) < SINGULAR else n * cos_theta / denominator
    return float(np.float32(t))


def _sums(x: list[torch.Tensor], length: int) -> list[dict[tuple[int, int], float]]:
    """Per row of the chunk, the exact sums of `pairs(len(x))`."""
    keys = pairs(len(x))
    return [dict(zip(keys, row, strict=True)) for row in rows.gram_rows(x, keys, length)]


def blend(base: torch.Tensor, tasks: Sequence[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """`t * avg + (1 - t) * base` in float32 (t: a float32 scalar, or one per row)."""
    import torch

    total = tasks[0] + 0  # mergekit's `sum(ws)` starts from the int 0
    for x in tasks[1:]:
        total = total + x
    average = total / torch.full_like(total, len(tasks))  # a true division on any device
    return t * average + (1 - t) * base


@dataclass(frozen=True)
class ModelStock(MergekitRule, Eager):
    """mergekit's `model_stock`: interpolate between the base and the mean of the task
    models by a ratio from the task vectors' angles."""

    name: str = "model_stock"
    label: str = "Model Stock"
    summary: str = (
        "Model Stock: the base and the models' mean, mixed by a ratio from the task vectors' angles"
    )
    reference: str = "Jang et al. 2024"
    rounds: int = 1
    rounds_note: str = "model_stock reads nothing in its round for filter_wise (t per row)"
    reads_stored: bool = True
    """The kernels read quantized inputs as stored: the Gram round's and filter_wise's row
    sums (`vector_sums_numba`) and the map pass (`blend_numba.stock`)."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (FILTER_WISE,)

    def whole_rows(self, params: TensorParams) -> bool:
        return bool(params["filter_wise"])

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        if n_tasks < 2:
            raise RamDistError(f"model_stock needs at least two task models, got {n_tasks}")
        whole = [name for name, p in params.items() if not p["filter_wise"]]
        return {"n": n_tasks, "t": {name: None for name in whole}}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return tensor in state["t"]

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        chunk = work.chunk
        import torch

        _, deltas = task_vectors(base, tasks)
        stats = [
            exact_sums.product_sum(deltas[i], None if i == j else deltas[j])
            for i, j in pairs(len(deltas))
        ]
        return {chunk.tensor: torch.stack(stats)}

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The round's exact sums by the records' Gram kernel (`fused_gram`), bin for bin
        `chunk_statistics`', quantized inputs as stored; None where numba is not
        installed."""
        chunk = work.chunk
        stats = fused_gram(inputs, pairs(len(inputs) - 1))
        return None if stats is None else ({chunk.tensor: stats}, None)

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype by `blend_numba.stock`, op for op the
        eager `blend`, the inputs as stored; filter_wise's ratios from the exact sums of
        the chunk's rows by the records' Gram kernel (`vector_sums_numba.gram` per row: the
        integers `rows.gram_rows` reads), on the inputs as stored too."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        from ram_dist import kernels

        kernel = kernels.numba_module("blend_numba")
        if kernel is None:
            return False
        base, *tasks = inputs
        if not params["filter_wise"]:
            t = state["t"][chunk.tensor]
            kernel.stock(base, tasks, out, ts=[float(t)], bf16_nan=bf16_nan)
            return True
        sums = kernels.numba_module("vector_sums_numba")
        length = rows.row_length(tuple(chunk.shape))
        keys = pairs(len(tasks))
        stats = sums.gram(base, tasks, sums.DELTAS, keys, length)
        ts = [
            ratio(dict(zip(keys, map(exact_sums.value, row), strict=True)), len(tasks))
            for row in stats
        ]
        kernel.stock(base, tasks, out, ts=ts, row=length, bf16_nan=bf16_nan)
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk (filter_wise's ratios from each chunk's rows), a
        quantized input as stored."""
        return True

    def finalize(self, end: RoundTotals) -> State:
        totals, state = end.totals, end.state
        n = state["n"]
        for name in state["t"]:
            if name in totals:
                values = [exact_sums.value(row) for row in totals[name]]
                state["t"][name] = ratio(dict(zip(pairs(n), values, strict=True)), n)
        return state

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        import torch

        b, ws = task_values(base, tasks)  # each against the base at its precision
        n = len(ws)
        if not params["filter_wise"]:
            t = torch.tensor(float(state["t"][chunk.tensor]), dtype=torch.float32, device=b.device)
            return blend(b, ws, t)
        length = rows.row_length(tuple(chunk.shape))
        _, deltas = task_vectors(base, tasks)
        ts = [ratio(sums, n) for sums in _sums(deltas, length)]
        t = torch.tensor(ts, dtype=torch.float32, device=b.device).reshape(-1, 1)
        shape = b.shape
        out = blend(b.reshape(-1, length), [x.reshape(-1, length) for x in ws], t)
        return out.reshape(shape)

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """The range of t over the tensors with one t (filter_wise: none)."""
        info = report.get("model_stock")
        if not info:
            return []
        return [
            f"model_stock t: {_shown(info['t_min'])} to {_shown(info['t_max'])} over "
            f"{info['tensors']} tensors "
            f"({info['t_zero']} at 0, mergekit's rule where 1 + (N - 1) cos is near 0)"
        ]

    def report(self, state: State) -> dict[str, Any]:
        ts = [float(t) for t in state.get("t", {}).values() if t is not None]
        if not ts:
            return {}
        finite = [t for t in ts if math.isfinite(t)]
        return {
            "model_stock": {
                "tensors": len(ts),
                "t_min": min(finite) if finite else None,
                "t_max": max(finite) if finite else None,
                "t_zero": sum(1 for t in ts if t == 0),
            }
        }


def _shown(t: float | None) -> str:
    return "none" if t is None else f"{t:.6g}"


#: `model_stock`, as `ram_dist.methods.METHODS` lists it.
METHODS = (ModelStock(),)
