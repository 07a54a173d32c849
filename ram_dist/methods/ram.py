"""RAM, RAM+ and RAM+s (Yuan et al. 2026), exactly as `docs/exactness.md` fixes them.

Per element: average the task vectors where two or more tasks changed the weight, keep
(times lambda_t) the update where only one task did, keep the base where none did. lambda_t
comes from overlap counts over the whole model (the paper's rule), so the reduce pass counts
and the map pass merges. `scope: tensor` (mergekit's `ramplus_tl`) counts per tensor instead
and computes rho and lambda in float32 as mergekit does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ram_dist.errors import RamDistError
from ram_dist.methods.decoder_layers import layer_index, layer_name
from ram_dist.methods.parameters import ALPHA, EPSILON, SCOPE, Parameter, R, variant
from ram_dist.methods.protocol import Chunk, Defaults, State, TensorParams
from ram_dist.methods.task_vectors import compute_dtype, task_vectors

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals


def _masks(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Base in the compute dtype, task vectors (each against the base at the task's
    precision), strict change masks and the count c."""
    import torch

    b, taus = task_vectors(base, tasks, compute_dtype(base, *tasks))
    masks = [tau.abs() > eps for tau in taus]
    count = torch.zeros(b.shape, dtype=torch.int64, device=b.device)
    for m in masks:
        count += m
    return b, taus, masks, count


def overlap_statistics(base: torch.Tensor, tasks: list[torch.Tensor], eps: float) -> torch.Tensor:
    """int64 [N+1, N+1]: row t < N is H[t][k] (k = 0..N, k = 0 always 0); row N counts c = k."""
    import torch

    _, _, masks, count = _masks(base, tasks, eps)
    n = len(tasks)
    rows = [torch.bincount(count[m], minlength=n + 1) for m in masks]
    rows.append(torch.bincount(count.reshape(-1), minlength=n + 1))
    return torch.stack(rows).to(device="cpu", dtype=torch.int64)


def rho(unique: int, shared: int) -> float:
    """shared / unique; +inf when only shared updates exist, 0 when the task changed nothing."""
    if unique == 0:
        return math.inf if shared > 0 else 0.0
    return shared / unique


def lambda_ram(rho_t: float, r: float, alpha: float) -> float:
    return 1.0


def lambda_ram_plus(rho_t: float, r: float, alpha: float) -> float:
    return 1.0 + r * min(max(rho_t, 0.0), alpha)


def lambda_ram_plus_soft(rho_t: float, r: float, alpha: float) -> float:
    if math.isinf(rho_t):
        return 1.0 + r
    return 1.0 + r * rho_t / (1.0 + rho_t)


LAMBDA_RULES: dict[str, Callable[[float, float, float], float]] = {
    "ram": lambda_ram,
    "ram_plus": lambda_ram_plus,
    "ram_plus_soft": lambda_ram_plus_soft,
}


def to_float32(value: float) -> float:
    """Round a float64 to the nearest float32 once (lambda_t is used only in this form)."""
    import torch

    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def lambda_tensor_local(unique: int, shared: int, r: float, alpha: float, eps: float) -> float:
    """mergekit's `ramplus_tl` lambda of one tensor, op for op in float32."""
    import torch

    rho32 = torch.tensor(shared, dtype=torch.int64) / torch.tensor(unique).clamp(min=eps)
    return float(1 + r * rho32.clamp(min=0, max=alpha))


def summarize(total: torch.Tensor, r: float, alpha: float) -> dict[str, Any]:
    """Whole-model statistics and lambda_t under every RAM variant (float64, then float32)."""
    n = total.shape[0] - 1
    by_count = [int(v) for v in total[n]]
    d = sum(by_count)
    tasks = []
    for t in range(n):
        hist = [int(v) for v in total[t, 1:]]
        unique, shared = hist[0], sum(hist[1:])
        rho_t = rho(unique, shared)
        tasks.append(
            {
                "changed": unique + shared,
                "density": (unique + shared) / d if d else 0.0,
                "unique": unique,
                "shared": shared,
                "rho": rho_t,
                "histogram": hist,
                "lambda": {
                    name: to_float32(rule(rho_t, r, alpha)) for name, rule in LAMBDA_RULES.items()
                },
            }
        )
    return {"participating": d, "unchanged": by_count[0], "by_count": by_count, "tasks": tasks}


def layer_summary(per_tensor: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per layer (`model.layers.{i}`, as `layers.layer_name` says: the layers parameters vary
    across; everything else is `other`), per task: changed, unique and shared elements and the
    layer's participating elements, for the per-layer table."""
    grouped: dict[str, torch.Tensor] = {}
    for name, total in per_tensor.items():
        key = layer_name(name) or "other"
        grouped[key] = grouped[key] + total if key in grouped else total.clone()

    def order(key: str) -> tuple[int, int]:
        return (1, 0) if key == "other" else (0, layer_index(key + ".") or 0)

    layers = []
    for key in sorted(grouped, key=order):
        total = grouped[key]
        n = total.shape[0] - 1
        participating = int(total[n].sum())
        tasks = [
            {
                "changed": int(total[t, 1:].sum()),
                "unique": int(total[t, 1]),
                "shared": int(total[t, 2:].sum()),
                "participating": participating,
            }
            for t in range(n)
        ]
        layers.append({"layer": key, "tasks": tasks})
    return layers


def merge_ram(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float, lambdas: list[float]
) -> torch.Tensor:
    """The per-element rule; returns theta in the compute dtype (the caller casts it)."""
    import torch

    b, taus, masks, count = _masks(base, tasks, eps)
    total = torch.zeros_like(b)
    lam = torch.zeros_like(b)
    for tau, m, lam_t in zip(taus, masks, lambdas, strict=True):
        total = total + torch.where(m, tau, 0.0)
        lam = torch.where(m, torch.tensor(lam_t, dtype=b.dtype), lam)
    unique = lam * total  # c == 1: the sum is the one active tau, exactly
    shared = total / count.to(b.dtype)
    merged = torch.where(count == 1, unique, shared)
    return torch.where(count == 0, b, b + merged)


#: The paper of the RAM family.
RAM_PAPER = "Yuan et al. 2026, Behavior Knowledge Merge in Reinforced Agentic Models"


@dataclass(frozen=True)
class RamMethod(Defaults):
    """One configured member of the RAM family; `rule` gives lambda_t from rho_t."""

    name: str
    rule: Callable[[float, float, float], float]
    alpha: float = 2.0
    scope: str = "model"
    rounds: int = 1
    reports_overlap: bool = True
    label: str = ""
    summary: str = ""
    reference: str = RAM_PAPER
    reads_stored: bool = True
    """The fused kernels read quantized inputs as they are stored."""
    writes_fp8: bool = True
    """The fused merge writes FP8 output (blocks and scales) in the same sweep."""
    statistics_parameters: ClassVar[tuple[str, ...]] = ("epsilon",)
    """Its counts take `epsilon` only (`r`, `alpha` and `scope` act in `finalize`)."""

    @property
    def description(self) -> str:
        text = (
            "Reinforced Agent Merging (Yuan et al. 2026): an element that no task changed keeps "
            "the base value; an element that exactly one task changed takes that task's update "
            "scaled by `lambda_t`; an element that two or more tasks changed takes the mean of "
            "their updates. A task's change counts where `abs(theta_t - theta_base) > epsilon`."
        )
        if self.rule is lambda_ram:
            return text + " RAM keeps every `lambda_t = 1`."
        if self.scope == "tensor":
            return text + " `lambda_t` is computed per tensor from that tensor's counts."
        return text + " `lambda_t` grows with the task's ratio `rho_t` of shared to unique changes."

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """r, alpha, epsilon (mergekit's `ramplus_tl` names) and `scope` (ram-dist's own),
        with this member's defaults."""
        return (R, variant(ALPHA, self.alpha), EPSILON, variant(SCOPE, self.scope))

    def check(self, params: TensorParams, where: str) -> None:
        """What the parameters' own checks cannot see: scope tensor needs RAM+'s rule."""
        if params["scope"] == "tensor" and self.rule is not lambda_ram_plus:
            raise RamDistError(f"{where}: scope: tensor is defined for ram_plus (ramplus_tl) only")

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        return {"n_tasks": n_tasks}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return True

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        chunk, params = work.chunk, work.params
        return {chunk.tensor: overlap_statistics(base, tasks, params["epsilon"])}

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], list[int] | None, np.ndarray | None]:
        """The overlap counts, and each input's NaN/Inf count and the precision check (where
        it can find something: `precision.needs_check`), from one sweep."""
        chunk, params, count_nonfinite = work.chunk, work.params, work.count_nonfinite
        from ram_dist.kernels import precision, ram_numba
        from ram_dist.kernels.views import kernel_view

        base, *tasks = inputs
        dtypes = [precision.array_dtype(kernel_view(x, False)) for x in inputs]
        if count_nonfinite and precision.needs_check(dtypes[0], dtypes[1:]):
            hist, counts, checks = ram_numba.overlap_counts_checked(
                base, tasks, params["epsilon"]
            )  # fmt: skip
            return {chunk.tensor: hist}, counts, checks
        if count_nonfinite:
            hist, counts = ram_numba.overlap_counts_nonfinite(base, tasks, params["epsilon"])
            return {chunk.tensor: hist}, counts, None
        return {chunk.tensor: ram_numba.overlap_counts(base, tasks, params["epsilon"])}, None, None

    def finalize(self, end: RoundTotals) -> State:
        totals, params, state = end.totals, end.params, end.state
        import torch

        size = state["n_tasks"] + 1
        model_total = sum(totals.values(), torch.zeros((size, size), dtype=torch.int64))
        any_params = next(iter(params.values()), {"r": 0.0, "alpha": 0.0, "scope": "model"})
        r, alpha = any_params["r"], any_params["alpha"]
        summary = summarize(model_total, r, alpha)
        out: State = {"summary": summary, "layers": layer_summary(totals)}
        if any_params["scope"] == "model":
            out["lambdas"] = [to_float32(self.rule(t["rho"], r, alpha)) for t in summary["tasks"]]
            return out
        out["tensor_lambdas"] = {
            name: [
                lambda_tensor_local(
                    int(total[t, 1]),
                    int(total[t, 2:].sum()),
                    params[name]["r"],
                    params[name]["alpha"],
                    params[name]["epsilon"],
                )
                for t in range(size - 1)
            ]  # fmt: skip
            for name, total in totals.items()
        }
        return out

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        if params["scope"] == "model":
            lambdas = state["lambdas"]
        else:
            lambdas = state["tensor_lambdas"][chunk.tensor]
        return merge_ram(base, tasks, params["epsilon"], lambdas)

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """The fused kernel's merge, written straight into `out` (FP8 blocks when it is an
        `Fp8Target`); it takes every chunk."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        from ram_dist.kernels import ram_numba
        from ram_dist.kernels.fp8 import Fp8Target

        base, *tasks = inputs
        lambdas = self._lambdas(chunk, state)
        if isinstance(out, Fp8Target):
            ram_numba.merge_ram_fp8(base, tasks, params["epsilon"], lambdas, out)
            return True
        ram_numba.merge_ram(base, tasks, params["epsilon"], lambdas, out, bf16_nan=bf16_nan)
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk, whatever the parameters."""
        return True

    def _lambdas(self, chunk: Chunk, state: State) -> list[float]:
        if "lambdas" in state:
            return state["lambdas"]
        return state["tensor_lambdas"][chunk.tensor]

    def report(self, state: State) -> dict[str, Any]:
        summary = state.get("summary") or {}
        tasks = [
            dict(t, rho="inf" if t["rho"] == math.inf else t["rho"])
            for t in summary.get("tasks", [])
        ]
        out = {
            "elements": {k: summary.get(k) for k in ("participating", "unchanged", "by_count")},
            "tasks": tasks,
            "layers": state.get("layers", []),
        }
        if "lambdas" in state:
            out["lambda_applied"] = state["lambdas"]
        else:
            out["lambda_per_tensor"] = state["tensor_lambdas"]
        return out

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """Nothing beyond the overlap table every report with task statistics prints."""
        return []


#: The RAM family, as `ram_dist.methods.METHODS` lists it.
METHODS = (
    RamMethod(
        "ram", lambda_ram, label="RAM (Reinforced Agent Merging)",
        summary="RAM: average where two or more agents changed a weight, keep a lone change",
    ),
    RamMethod(
        "ram_plus", lambda_ram_plus, label="RAM+ (clipped linear rescaling, Eq. 6)",
        summary="RAM+: as `ram`, with lone changes scaled up (clipped linear, the paper's Eq. 6)",
    ),
    RamMethod(
        "ram_plus_soft", lambda_ram_plus_soft, label="RAM+s (soft-saturation rescaling, Eq. 8)",
        summary="RAM+s: as `ram_plus`, with soft-saturation scaling (Eq. 8)",
    ),
    RamMethod(
        "ramplus_tl", lambda_ram_plus, alpha=0.2, scope="tensor",
        label="RAM+ with lambda per tensor (mergekit's ramplus_tl)",
        summary="RAM+ with its scale computed per tensor, as mergekit's `ramplus_tl`",
    ),
)  # fmt: skip
