"""mergekit's `arcee_fusion` (`ArceeFusion`, listed in `METHODS`): take the task model's
value where its change is important, keep the base's elsewhere.

Per tensor, with the base `a` and the one task model `b` (float32):
importance `I = |b - a| * kl`, where `kl` is, per row (mergekit's `dim=-1`; a 1-D tensor is
one row), `sum_i p_i log(p_i / q_i)` with `p = softmax(b) + 1e-8`, `q = softmax(a) + 1e-8`;
threshold `T = median(I) + 1.5 * (q3(I) - q1(I))`, the quantiles being the elements of
ranks `floor(q (n - 1))` (0-based, ascending) for q = 1/4, 1/2, 3/4; then
`a + (b - a) * (I >= T)` in float32.

Computed here:
* `kl` per row inside a chunk (the tensor's units hold whole rows, `whole_rows`): in
  float64, by `float64_math`'s exp and log and row sums in a fixed pairwise order
  (`rows.tree_sums`): IEEE operations only, so every device gives the same bits; then
  rounded to float32 once. `I` is then one float32 product, as in mergekit. On the CPU the
  fused kernel (`kernels/arcee_numba.py`) takes the same steps, for both rounds and the map
  pass, reading quantized inputs as stored (`reads_stored`).
* The three quantiles are exact selections over the whole tensor, by counting: round 0
  histograms the top 16 bits of an order-preserving key of each float32 `I`, round 1 the
  low 16 bits within the bins that hold the three ranks. T is taken on the driver in
  float32, op by op as torch computes mergekit's expression. The map pass is element-wise.

Differences from mergekit: mergekit takes its quantiles from a random sample of 1,000,000
elements (drawn with torch's global generator) when a tensor has more elements; here they
are always those of the whole tensor (the same as mergekit's below that size). mergekit
computes `kl` in float32 with torch's softmax and log, whose last bits vary with the
device; ours is the float64 value rounded once, so an element whose importance lies within
that rounding of T may be selected differently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.methods import float64_math, rows
from ram_dist.methods.generalized_task_arithmetic import topk
from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import Eager, MergekitRule, State, TensorParams
from ram_dist.methods.task_vectors import task_values

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: mergekit's smoothing of both distributions before the log.
EPS = 1e-8
HIGH_BINS = 1 << 16  # keys are 32 bits here: every float32, sign included
QUANTILES = (1, 2, 3)  # quartiles: q = i / 4
_NAN_KEY = (1 << 32) - 1


def quantile_ranks(numel: int) -> list[int]:
    """0-based ascending ranks of mergekit's quartiles: `floor(q * (numel - 1))`."""
    return [(i * (numel - 1)) // 4 for i in QUANTILES]


def _softmax(x: torch.Tensor, length: int) -> torch.Tensor:
    """float64 softmax of each row of float32 `x` (flat, whole rows of `length`)."""
    import torch

    v = x.to(torch.float32).reshape(-1, length).to(torch.float64)
    shifted = v - v.amax(dim=1, keepdim=True)
    e = float64_math.exp(shifted)
    return e / rows.tree_sums(e, length).reshape(-1, 1)


def row_kl(base: torch.Tensor, task: torch.Tensor, length: int) -> torch.Tensor:
    """float32 kl of each row: float64 throughout, rounded once."""
    import torch

    p = _softmax(task, length) + EPS
    q = _softmax(base, length) + EPS
    terms = p * float64_math.log(p / q)
    return rows.tree_sums(terms, length).to(torch.float32)


def importance(base: torch.Tensor, task: torch.Tensor, length: int) -> torch.Tensor:
    """float32 `|b - a| * kl`, flat, for a chunk of whole rows."""
    import torch

    a = base.to(torch.float32).reshape(-1, length)
    b = task.to(torch.float32).reshape(-1, length)
    return (torch.abs(b - a) * row_kl(a, b, length).reshape(-1, 1)).reshape(-1)


def _pair(base: torch.Tensor, tasks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The base and the one model in float32, the model's values measured against the base
    at its precision (`task_values`)."""
    a, (b,) = task_values(base, tasks[:1])
    return a, b


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered as the float32 values (-0 as +0, NaN the largest)."""
    import torch

    bits = (values.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)  # -0 -> +0
    keys = torch.where(bits >= 0, bits + (1 << 31), ~bits)
    return torch.where(torch.isnan(values), torch.full_like(keys, _NAN_KEY), keys)


def key_value(key: int) -> float:
    """The float32 value of an order key (a Python float)."""
    import numpy as np

    bits = key - (1 << 31) if key >= 1 << 31 else ~key
    return float(np.array([bits], dtype=np.int64).astype(np.int32).view(np.float32)[0])


def threshold(q1: float, median: float, q3: float) -> float:
    """`median + 1.5 * (q3 - q1)`, in float32 as torch computes it."""
    import numpy as np

    f = np.float32
    with np.errstate(all="ignore"):
        return float(f(median) + f(1.5) * (f(q3) - f(q1)))


@dataclass(frozen=True)
class ArceeFusion(MergekitRule, Eager):
    """mergekit's `arcee_fusion`: the task model's values where their importance is an
    outlier (above median + 1.5 IQR), the base's elsewhere."""

    name: str = "arcee_fusion"
    label: str = "Arcee Fusion"
    summary: str = "Arcee Fusion: one model's changes whose KL-weighted importance is an outlier"
    reference: str = "Arcee AI, mergekit v0.1 (2025)"
    task_counts: tuple[int, int | None] = (1, 1)
    rounds: int = 2
    parameters: tuple[Parameter, ...] = ()
    reads_stored: bool = True
    """Its kernels (`arcee_numba`: the importances of both rounds and the map pass) read
    quantized inputs as stored."""

    @property
    def description(self) -> str:
        return (
            "`arcee_fusion` as mergekit defines it, streamed unit by unit on Ray, with two "
            "differences: each row's KL divergence is taken in float64 and rounded once "
            "(mergekit: float32), and the quartiles are those of the whole tensor (mergekit "
            "samples 1M elements of a larger tensor at random)."
        )

    def whole_rows(self, params: TensorParams) -> bool:
        return True

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        return {"tensors": {name: {"numel": numel[name]} for name in params if numel[name]}}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return tensor in state["tensors"]

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        round_, chunk, state = work.round_, work.chunk, work.state
        import torch

        length = rows.row_length(tuple(chunk.shape))
        keys = order_keys(importance(*_pair(base, tasks), length))
        if round_ == 0:
            hist = torch.bincount(keys >> 16, minlength=HIGH_BINS).to(torch.int64)
            return {chunk.tensor: hist}
        info = state["tensors"][chunk.tensor]
        hists = [topk.low_histogram(keys, b) for b in info["high_bins"]]
        return {chunk.tensor: torch.stack(hists)}

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The round's histogram of the importances by `arcee_numba.importance` (the KL in
        float64, step for step the eager rule's) and `arcee_numba.histogram`, bin for bin
        `chunk_statistics`'."""
        round_, chunk, state = work.round_, work.chunk, work.state
        from ram_dist import kernels

        kernel = kernels.numba_module("arcee_numba")
        if kernel is None:
            return None
        imp = kernel.importance(inputs[0], inputs[1], rows.row_length(tuple(chunk.shape)))
        high = [] if round_ == 0 else state["tensors"][chunk.tensor]["high_bins"]
        return {chunk.tensor: kernel.histogram(imp, high)}, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype: the importances by
        `arcee_numba.importance`, the selection by `arcee_numba.merge`."""
        chunk, state, bf16_nan = work.chunk, work.state, work.bf16_nan
        from ram_dist import kernels

        kernel = kernels.numba_module("arcee_numba")
        info = state["tensors"].get(chunk.tensor)
        if kernel is None or info is None:  # an empty tensor: the eager rule
            return False
        base, task = inputs[0], inputs[1]
        imp = kernel.importance(base, task, rows.row_length(tuple(chunk.shape)))
        kernel.merge(base, task, imp, float(info["threshold"]), out, bf16_nan=bf16_nan)
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk (whole rows: each row's KL inside its chunk)."""
        return True

    def finalize(self, end: RoundTotals) -> State:
        round_, totals, state = end.round_, end.totals, end.state
        for name, info in state["tensors"].items():
            if name not in totals:
                continue
            n = info["numel"]
            wanted = [n - r for r in quantile_ranks(n)]  # the k-th largest, k from 1
            if round_ == 0:
                highs = [topk.find_high_bin(totals[name], k) for k in wanted]
                info["high_bins"] = [h.high_bin for h in highs]
                info["above"] = [h.above for h in highs]
                continue
            values = []
            for t, k in enumerate(wanted):
                high = topk.HighCut(info["high_bins"][t], info["above"][t])
                values.append(key_value(topk.find_cut(totals[name][t], high, k).threshold))
            info["quartiles"] = values
            info["threshold"] = threshold(*values)
        return state

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, state = work.chunk, work.state
        import torch

        a, b = _pair(base, tasks)
        info = state["tensors"].get(chunk.tensor)
        if info is None:  # an empty tensor
            return a
        length = rows.row_length(tuple(chunk.shape))
        limit = torch.tensor(float(info["threshold"]), dtype=torch.float32, device=a.device)
        mask = (importance(a, b, length) >= limit).to(torch.float32).reshape(a.shape)
        return a + (b - a) * mask

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        info = report.get("arcee_fusion")
        if not info:
            return []
        return [
            f"arcee_fusion: thresholds over {info['tensors']} tensors, "
            f"{info['zero_threshold']} of them at importance 0 or below (every change kept)"
        ]

    def report(self, state: State) -> dict[str, Any]:
        tensors = state.get("tensors", {})
        if not tensors:
            return {}
        zero = sum(1 for i in tensors.values() if float(i.get("threshold", 1.0)) <= 0)
        return {"arcee_fusion": {"tensors": len(tensors), "zero_threshold": zero}}


#: `arcee_fusion`, as `ram_dist.methods.METHODS` lists it.
METHODS = (ArceeFusion(),)
