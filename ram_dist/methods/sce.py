"""mergekit's `sce` (`SCE`, listed in `METHODS`; select, calculate, erase: Wan et al. 2024,
FuseChat).

Per tensor, with task vectors `d_t = theta_t - theta_B` (float32):
1. Select (only when `select_topk` < 1): the per-element variance of the d_t across tasks
   (population variance, as `torch.var(unbiased=False)`); keep, in every d_t, the
   `k = int(float32(nonzero) * float32(select_topk))` positions of largest variance, where
   `nonzero` counts the positions of non-zero variance (k = 0: keep none).
2. Calculate: per task the mean of squares of its (selected) d_t; weights are those over
   their sum (each 1/N when the sum is below 1e-6).
3. Erase: TIES's sign election on the unweighted d_t (`s = +1 if sum_t d_t >= 0`), each
   kept where its sign is s; `theta_B + sum_t w_t kept d_t / max(sum_t w_t kept_t, 1e-6)`.

Computed here:
* The variance is element-wise: float64 Welford steps op by op (mean, M2; the recurrence
  torch's CPU `var` runs in double), rounded to float32; byte-identical to torch's CPU
  `var` in our trials, and the same on any device (each step is one IEEE operation).
* The top-k is TIES's exact cut (`topk.py`) on those float32 variances, ties at the cut
  to the lowest flat index: rounds 0-1 (value histograms, and the count of non-zero
  variances), rounds 2-3 only where the cut splits equal variances. mergekit's
  `torch.topk` picks arbitrarily among equal variances at the cut.
* The means of squares are exact sums (`exact_sums.product_sum`) of the selected d_t in
  the round after the cut is known (round 2, or 4 when the index rounds ran; round 0
  without selection); the weights are taken once per tensor on the driver in float64 and
  rounded to float32 once. mergekit sums in float32, so its weights may differ by an ulp.
* The map pass is element-wise float32, mergekit's expression op by op (task sums in task
  order, as torch's `sum(dim=0)` adds up to 4 tasks); on the CPU by the fused kernel
  (`kernels/sce_numba.py`), the variance selection included, which reads quantized inputs
  as stored (`reads_stored`), as the rounds' kernels do (`sce_numba.statistics`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.methods import exact_sums
from ram_dist.methods.generalized_task_arithmetic import topk
from ram_dist.methods.generalized_task_arithmetic.combine import ordered_sum, task_vectors
from ram_dist.methods.model_stock import fused_gram
from ram_dist.methods.parameters import INT8_MASK, Parameter
from ram_dist.methods.protocol import Eager, MergekitRule, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

NONZERO = "#nonzero"
SQUARES = "#squares"
#: mergekit's floors: of the weights' sum (below: equal weights), and of the divisor.
WEIGHT_SUM_EPS = 1e-6
MIN_DIVISOR = 1e-6


def _select_topk(value: Any, where: str) -> None:
    if not 0 < value <= 1:
        raise RamDistError(
            f"{where}: parameter select_topk must be in (0, 1] (the share of positions kept "
            f"by variance; 1 keeps all), got {value}"
        )


SELECT_TOPK = Parameter(
    "select_topk", 1.0, "share of positions kept, those of largest variance across tasks",
    cli_flag="--select-topk", check=_select_topk,
)  # fmt: skip


def variance(deltas: list[torch.Tensor]) -> torch.Tensor:
    """float32 population variance across tasks, per element: float64 Welford steps."""
    import torch

    mean = torch.zeros(deltas[0].shape, dtype=torch.float64, device=deltas[0].device)
    m2 = torch.zeros_like(mean)
    for count, d in enumerate(deltas, start=1):
        x = d.to(torch.float64)
        delta = x - mean
        mean = mean + delta / torch.full_like(delta, count)  # a true division on any device
        m2 = m2 + delta * (x - mean)
    return (m2 / torch.full_like(m2, len(deltas))).to(torch.float32)


def kept_positions(nonzero: int, select_topk: float, numel: int) -> int:
    """mergekit's k: `int(count_nonzero(var) * select_topk)`, a float32 product."""
    import numpy as np

    return min(int(np.float32(np.float32(nonzero) * np.float32(select_topk))), numel)


def weights(squares: list[float], numel: int) -> list[float]:
    """Driver: float32 weights from the exact sums of squares of the selected d_t."""
    import numpy as np

    means = [s / numel for s in squares]
    total = math.fsum(means)
    if abs(total) < WEIGHT_SUM_EPS:
        return [float(np.float32(1.0 / len(means)))] * len(means)
    return [float(np.float32(m / total)) for m in means]


def _ordered(info: dict[str, Any]) -> bool:
    return info.get("need") is not None and info["need"] < info["equal"]


@dataclass(frozen=True)
class SCE(MergekitRule, Eager):
    """mergekit's `sce`: variance selection, mean-of-squares weights, sign election."""

    name: str = "sce"
    label: str = "SCE"
    summary: str = (
        "SCE: keep the positions of largest variance, weight tasks by mean square, elect a sign"
    )
    reference: str = "Wan et al. 2024 (FuseChat)"
    task_counts: tuple[int, int | None] = (1, None)
    rounds: int = 5
    rounds_note: str = (
        "sce's rounds 2-3 read only where the variance cut falls inside equal variances; "
        "without selection only one round runs"
    )
    reads_stored: bool = True
    """The kernels read quantized inputs as stored: the map pass (`sce_numba.merge`), the
    selection's rounds (`sce_numba.statistics`) and the sums of squares."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (SELECT_TOPK, INT8_MASK)

    def check(self, params: TensorParams, where: str) -> None:
        return None

    # -- reduce rounds ------------------------------------------------------------------

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        tensors = {}
        for name, p in params.items():
            select = float(p["select_topk"]) < 1 and numel[name] > 0
            tensors[name] = {"select": select, "k": None, "weights": None}
        return {"n": n_tasks, "tensors": tensors}

    def _squares_round(self, info: dict[str, Any]) -> int | None:
        """The round that sums the squares of the selected d_t (None: none needed)."""
        if not info["select"]:
            return 0
        if info["k"] == 0:
            return None  # nothing selected: the weights are equal
        return 4 if _ordered(info) else 2

    def active(self, round_: int, state: State, tensor: str) -> bool:
        info = state["tensors"].get(tensor)
        if info is None:
            return False
        if round_ == self._squares_round(info) and info["weights"] is None:
            return True
        return self._cut_round(round_, info)

    @staticmethod
    def _cut_round(round_: int, info: dict[str, Any]) -> bool:
        """Whether round `round_` histograms the variances (the cut's rounds)."""
        if not info["select"]:
            return False
        if round_ == 0:
            return True
        if info["k"] == 0:
            return False
        return round_ == 1 or (round_ in (2, 3) and _ordered(info))

    def _mask(self, info: dict[str, Any], deltas: list[torch.Tensor], start: int) -> Any:
        """The selection's keep mask of a chunk (flat, bool)."""
        import torch

        keys = topk.magnitude_keys(variance(deltas))
        if info["k"] == 0:
            return torch.zeros_like(keys, dtype=torch.bool)
        return topk.keep_mask(keys, info["threshold"], start, info.get("index_cut"))

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        round_, chunk, state = work.round_, work.chunk, work.state
        import torch

        info = state["tensors"][chunk.tensor]
        _, deltas = task_vectors(base, tasks)
        out: dict[str, torch.Tensor] = {}
        if round_ == self._squares_round(info) and info["weights"] is None:
            if info["select"]:
                keep = self._mask(info, deltas, chunk.start)
                deltas = [d.reshape(-1) * keep for d in deltas]
            squares = [exact_sums.product_sum(d) for d in deltas]
            out[chunk.tensor + SQUARES] = torch.stack(squares)
        if not self._cut_round(round_, info):
            return out
        keys = topk.magnitude_keys(variance(deltas))
        if round_ == 0:
            out[chunk.tensor] = topk.high_histogram(keys)
            out[chunk.tensor + NONZERO] = (keys != 0).sum().reshape(1).to(torch.int64)
        elif round_ == 1:
            out[chunk.tensor] = topk.low_histogram(keys, info["high_bin"])
        elif round_ == 2:
            out[chunk.tensor] = topk.index_high_histogram(
                keys, info["threshold"], chunk.start, chunk.numel
            )
        else:
            out[chunk.tensor] = topk.index_low_histogram(
                keys, info["threshold"], chunk.start, info["index_bin"]
            )
        return out

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """`chunk_statistics`, bin for bin, the inputs as stored: without selection, the
        sums of squares by the records' Gram kernel (`model_stock.fused_gram`); with it,
        the variance rounds' histograms and the kept vectors' sums of squares by
        `sce_numba.statistics`. None where numba is not installed."""
        chunk, state, round_ = work.chunk, work.state, work.round_
        from ram_dist import kernels

        info = state["tensors"][chunk.tensor]
        if not info["select"]:
            n = len(inputs) - 1
            stats = fused_gram(inputs, [(t, t) for t in range(n)])
            return None if stats is None else ({chunk.tensor + SQUARES: stats}, None)
        kernel = kernels.numba_module("sce_numba")
        if kernel is None:
            return None
        import numpy as np

        base, *tasks = inputs
        out: dict[str, np.ndarray] = {}
        if round_ == self._squares_round(info) and info["weights"] is None:
            out[chunk.tensor + SQUARES], _ = kernel.statistics(
                base, tasks, kernel.SQUARES, threshold=int(info["threshold"]),
                index_cut=info.get("index_cut"), start=chunk.start,
            )  # fmt: skip
        if not self._cut_round(round_, info):
            return out, None
        if round_ == 0:
            hist, nonzero = kernel.statistics(base, tasks, kernel.HIGH, size=topk.HIGH_BINS)
            out[chunk.tensor] = hist
            out[chunk.tensor + NONZERO] = np.array([nonzero], np.int64)
        elif round_ == 1:
            out[chunk.tensor], _ = kernel.statistics(
                base, tasks, kernel.LOW, size=topk.LOW_BINS, select_bin=int(info["high_bin"])
            )  # fmt: skip
        else:
            index = round_ == 2
            out[chunk.tensor], _ = kernel.statistics(
                base, tasks, kernel.INDEX_HIGH if index else kernel.INDEX_LOW,
                size=topk.index_bins(chunk.numel) if index else topk.LOW_BINS,
                threshold=int(info["threshold"]), start=chunk.start,
                select_bin=-1 if index else int(info["index_bin"]),
            )  # fmt: skip
        return out, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype by `sce_numba.merge`, op for op the
        eager rule, the variance selection included, the inputs as stored."""
        chunk, state, bf16_nan = work.chunk, work.state, work.bf16_nan
        from ram_dist import kernels

        kernel = kernels.numba_module("sce_numba")
        if kernel is None:
            return False
        info = state["tensors"][chunk.tensor]
        select, threshold, index_cut = kernel.SELECT_NONE, -1, None
        if info["select"] and info["k"] == 0:
            select = kernel.SELECT_EMPTY
        elif info["select"]:
            select, threshold = kernel.SELECT_CUT, int(info["threshold"])
            index_cut = info.get("index_cut")
        base, *tasks = inputs
        kernel.merge(
            base, tasks, out, weights=[float(w) for w in info["weights"]], select=select,
            threshold=threshold, index_cut=index_cut, start=chunk.start, bf16_nan=bf16_nan,
        )  # fmt: skip
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk, the variance selection's rounds included."""
        return True

    def finalize(self, end: RoundTotals) -> State:
        round_, totals, params, numel, state = (
            end.round_,
            end.totals,
            end.params,
            end.numel,
            end.state,
        )
        n = state["n"]
        for name, info in state["tensors"].items():
            if name + SQUARES in totals:
                squares = [exact_sums.value(row) for row in totals[name + SQUARES]]
                info["weights"] = weights(squares, numel[name])
            if name not in totals:
                continue
            total = totals[name]
            if round_ == 0:
                select = float(params[name]["select_topk"])
                nonzero = int(totals[name + NONZERO][0])
                info["k"] = k = kept_positions(nonzero, select, numel[name])
                if k == 0:
                    info["weights"] = weights([0.0] * n, numel[name])
                    continue
                high = topk.find_high_bin(total, k)
                info.update(high_bin=high.high_bin, above=high.above)
            elif round_ == 1:
                high = topk.HighCut(info["high_bin"], info["above"])
                cut = topk.find_cut(total, high, info["k"])
                info.update(threshold=cut.threshold, need=cut.need_at_threshold)
                info["equal"] = cut.equal_at_threshold
            elif round_ == 2:
                found = topk.find_index_bin(total, info["need"])
                info.update(index_bin=found.index_bin, need_in_bin=found.need_in_bin)
            elif round_ == 3:
                found = topk.IndexBin(info["index_bin"], info["need_in_bin"])
                info["index_cut"] = topk.find_index_cut(total, found)
        return state

    # -- map pass ----------------------------------------------------------------------

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, state = work.chunk, work.state
        import torch

        info = state["tensors"][chunk.tensor]
        b, deltas = task_vectors(base, tasks)
        if info["select"]:
            keep = self._mask(info, deltas, chunk.start).reshape(b.shape).to(torch.float32)
            deltas = [d * keep for d in deltas]
        majority = (ordered_sum(deltas) >= 0).to(torch.float32) * 2 - 1
        w = torch.tensor([float(x) for x in info["weights"]], dtype=torch.float32, device=b.device)
        erased = [w[t] * (d.sign() == majority) for t, d in enumerate(deltas)]
        merged = ordered_sum([d * e for d, e in zip(deltas, erased, strict=True)])
        divisor = ordered_sum(erased).clamp(min=MIN_DIVISOR)
        return b + merged / divisor

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """How many tensors were selected by variance, and how many cuts needed flat order."""
        info = report.get("sce")
        if not info:
            return []
        return [
            f"sce: {info['selected_tensors']} tensors selected by variance, "
            f"cuts through equal variances: {info['cuts_through_equal_variances']}"
        ]

    def report(self, state: State) -> dict[str, Any]:
        tensors = state.get("tensors", {}).values()
        selected = [i for i in tensors if i["select"]]
        if not selected:
            return {}
        ordered = sum(1 for i in selected if _ordered(i))
        return {"sce": {"selected_tensors": len(selected), "cuts_through_equal_variances": ordered}}


#: `sce`, as `ram_dist.methods.METHODS` lists it.
METHODS = (SCE(),)
