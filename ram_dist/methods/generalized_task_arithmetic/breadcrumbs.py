"""Model Breadcrumbs (`breadcrumbs`, `breadcrumbs_ties`): per task, drop the largest `gamma`
share of |delta| (outliers) and the smallest, keeping `density` of the tensor, then the
weighted combine step (`breadcrumbs_ties`: with TIES's sign election).

mergekit's rule (`sparsify.magnitude_outliers`), per (tensor, task) with n elements: keep
`target = int(density * n)` elements, drop `top = int(gamma * n)` largest first, but never
so many that fewer than `target` remain: in descending order of |delta| the kept elements
are the positions [a, a + target) with `a = min(top, n - target)`. density >= 1 leaves the
delta untouched (gamma or not); `target = 0` drops everything.

Here the descending order is total: |delta| by its float32 bits (`topk.magnitude_keys`),
ties to the lowest flat index first, so the kept set is `top-(a + target)` minus `top-a`,
two of TIES's exact cuts (`topk`) found by the same counting histograms in the same four
reduce rounds: round 0 one magnitude histogram per task serves both cuts, rounds 1-3 have a
row per cut. A cut at 0 (`a == 0`) or at n (`a + target == n`) is no cut. Where equal
magnitudes straddle a cut, mergekit's ascending `torch.sort` (not stable) picks among them
arbitrarily; elsewhere the kept sets, and so the bytes, are mergekit's. The rounds run on
TIES's histogram kernel and the map pass on its merge kernel (`ties_numba`, the kept set
between the two cuts: `KEEP_BETWEEN`), but with L1 rescaling.

`rescale` (default false) is mergekit's L1 rule (`dare`): round 0 sums the L1 statistic of
delta, round 2 those of the keys above each cut; the kept L1 is `L1(top-b) - L1(top-a)`, an
exact difference of integer bins, each top-k's L1 being its keys above the cut plus the
kept copies of the cut's value (`ties.kept_l1`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.methods.generalized_task_arithmetic import combine, dare, ties, topk
from ram_dist.methods.parameters import (
    DENSITY,
    GAMMA,
    INT8_MASK,
    LAMBDA,
    NORMALIZE,
    RESCALE,
    WEIGHT,
    Parameter,
)
from ram_dist.methods.protocol import Eager, MergekitRule, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

L1 = "#l1"
L1_ABOVE = "#l1-above"
#: The two cuts of a task, in the order of their rows: the outliers' (top-a) and the kept
#: set's lower end (top-b).
TOP, BOTTOM = 0, 1


def kept_range(density: float, gamma: float, numel: int) -> tuple[int, int]:
    """mergekit's kept positions [a, b) in descending order of magnitude."""
    target = int(density * numel)
    top = int(gamma * numel)
    a = min(top, numel - target)
    return a, a + target


def _ordered(cut: dict[str, Any] | None) -> bool:
    """Whether a cut needs the flat-index rounds: it splits equal non-zero magnitudes (at
    zero the choice changes no byte, as for TIES)."""
    return cut is not None and cut["need"] < cut["equal"] and cut["threshold"] != 0


def _cut(k: int, numel: int) -> dict[str, Any] | None:
    """A top-k cut to find, or None where top-k is nothing (k = 0) or everything (k = n)."""
    return {"k": k} if 0 < k < numel else None


def task_plan(density: float, gamma: float, numel: int) -> dict[str, Any] | None:
    """Driver: what one task of a tensor needs: None (untouched), or its kept range and the
    two cuts (`TOP`, `BOTTOM`)."""
    if density >= 1 or numel == 0:
        return None
    a, b = kept_range(density, gamma, numel)
    cuts = [None, None] if a == b else [_cut(a, numel), _cut(b, numel)]
    return {"a": a, "b": b, "cuts": cuts}


def _cuts(info: dict[str, Any]) -> list[tuple[int, int, dict[str, Any]]]:
    """(task, which, cut) of every cut a tensor's tasks need."""
    return [
        (t, which, c)
        for t, plan in enumerate(info["tasks"])
        if plan is not None
        for which, c in enumerate(plan["cuts"])
        if c is not None
    ]


def in_top(keys: torch.Tensor, cut: dict[str, Any] | None, k_all: bool, start: int):
    """bool mask of a chunk's keys among the top-k (None cut: all when `k_all`, else none)."""
    import torch

    if cut is None:
        return torch.full_like(keys, k_all, dtype=torch.bool)
    return topk.keep_mask(keys, cut["threshold"], start, cut.get("index_cut"))


def keep_mask(keys: torch.Tensor, plan: dict[str, Any], start: int) -> torch.Tensor:
    """Map pass: the chunk's kept elements, top-b and not top-a."""
    top, bottom = plan["cuts"]
    if plan["a"] == plan["b"]:
        return in_top(keys, None, False, start)
    return in_top(keys, bottom, True, start) & ~in_top(keys, top, False, start)


def _bounds(cut: dict[str, Any] | None, k_all: bool) -> tuple[int, int]:
    """A top-k cut as `ties_numba.merge` takes it: (threshold key, index cut or -1); no cut
    (`in_top`'s None): every key when `k_all`, else none."""
    from ram_dist.kernels import ties_numba

    if cut is None:
        return (-1, -1) if k_all else (ties_numba.NOTHING, -1)
    return cut["threshold"], cut.get("index_cut", -1)


def _top_l1(
    plan: dict[str, Any], which: int, total: torch.Tensor, above: torch.Tensor | None
) -> torch.Tensor:
    """Driver: the L1 statistic of a task's top-a (`TOP`) or top-b (`BOTTOM`) elements, from
    the whole delta's (`total`) and, for a real cut, that of the keys above it (`above`)."""
    import torch

    cut = plan["cuts"][which]
    if cut is None:  # top-0 or top-n
        k = plan["a"] if which == TOP else plan["b"]
        return total if k > 0 else torch.zeros_like(total)
    if above is None:
        raise ValueError("a cut's L1 needs round 2's statistic of the keys above it")
    found = topk.Cut(cut["threshold"], cut["need"], cut["equal"])
    return ties.kept_l1(above[which], found)


def _zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    import torch

    return torch.zeros(shape, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Breadcrumbs(MergekitRule, Eager):
    """mergekit's `breadcrumbs` (`consensus=False`) and `breadcrumbs_ties` (`True`)."""

    name: str
    consensus: bool
    label: str = ""
    summary: str = ""
    reference: str = "Davari and Belilovsky 2023"
    reads_stored: bool = True
    """Its kernels (`ties_numba`) read quantized inputs as stored."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """mergekit's: weight, density, gamma per task; normalize, lambda, rescale (all
        defaults false/1 for both members)."""
        return (WEIGHT, DENSITY, GAMMA, NORMALIZE, LAMBDA, RESCALE, INT8_MASK)

    rounds = 4
    rounds_note = (
        "breadcrumbs needs its 3rd and 4th round only where a cut falls inside equal magnitudes"
    )

    # -- reduce rounds ------------------------------------------------------------------

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        tensors: dict[str, Any] = {}
        for name, p in params.items():
            plans = [
                task_plan(float(d), float(g), numel[name])
                for d, g in zip(p["density"], p["gamma"], strict=True)
            ]
            rescale = bool(p["rescale"]) and any(plan is not None for plan in plans)
            tensors[name] = {"tasks": plans, "rescale": rescale}
        return {"tensors": tensors}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        info = state["tensors"].get(tensor)
        if info is None:
            return False
        cuts = _cuts(info)
        if round_ == 0:
            return bool(cuts) or info["rescale"]
        if round_ == 1:
            return bool(cuts)
        ordered = any(_ordered(c) for _, _, c in cuts)
        return ordered or (round_ == 2 and info["rescale"] and bool(cuts))

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        round_, chunk, state = work.round_, work.chunk, work.state
        import torch

        info = state["tensors"][chunk.tensor]
        plans = info["tasks"]
        _, deltas = combine.task_vectors(base, tasks)
        keys = [topk.magnitude_keys(d) for d in deltas]
        device = base.device
        n = len(tasks)
        out: dict[str, torch.Tensor] = {}
        if round_ == 0:
            hist = _zeros((n, topk.HIGH_BINS), device)
            for t, plan in enumerate(plans):
                if plan is not None and any(plan["cuts"]):
                    hist[t] = topk.high_histogram(keys[t])
            out[chunk.tensor] = hist
            if info["rescale"]:
                out[chunk.tensor + L1] = torch.stack([dare.l1_statistic(d) for d in deltas])
            return out
        size = topk.index_bins(chunk.numel) if round_ == 2 else topk.LOW_BINS
        hist = _zeros((n, 2, size), device)
        for t, which, c in _cuts(info):
            k = keys[t]
            if round_ == 1:
                hist[t, which] = topk.low_histogram(k, c["high_bin"])
            elif not _ordered(c):
                continue
            elif round_ == 2:
                hist[t, which] = topk.index_high_histogram(
                    k, c["threshold"], chunk.start, chunk.numel
                )
            else:
                hist[t, which] = topk.index_low_histogram(
                    k, c["threshold"], chunk.start, c["index_bin"]
                )
        out[chunk.tensor] = hist
        if round_ == 2 and info["rescale"]:
            above = _zeros((n, 2, dare.L1_BINS), device)
            for t, which, c in _cuts(info):
                above[t, which] = dare.l1_statistic(
                    deltas[t].reshape(-1) * (keys[t] > c["threshold"])
                )
            out[chunk.tensor + L1_ABOVE] = above
        return out

    def finalize(self, end: RoundTotals) -> State:
        round_, totals, state = end.round_, end.totals, end.state
        for name, info in state["tensors"].items():
            if name not in totals:
                continue
            total = totals[name]
            for t, which, cut in _cuts(info):
                if round_ == 0:
                    high = topk.find_high_bin(total[t], cut["k"])
                    cut.update(high_bin=high.high_bin, above=high.above)
                elif round_ == 1:
                    high = topk.HighCut(cut["high_bin"], cut["above"])
                    found = topk.find_cut(total[t, which], high, cut["k"])
                    cut.update(threshold=found.threshold, need=found.need_at_threshold)
                    cut["equal"] = found.equal_at_threshold
                elif _ordered(cut) and round_ == 2:
                    found_bin = topk.find_index_bin(total[t, which], cut["need"])
                    cut.update(index_bin=found_bin.index_bin, need_in_bin=found_bin.need_in_bin)
                elif _ordered(cut) and round_ == 3:
                    found_bin = topk.IndexBin(cut["index_bin"], cut["need_in_bin"])
                    cut["index_cut"] = topk.find_index_cut(total[t, which], found_bin)
            if round_ == 0 and name + L1 in totals:
                for t, plan in enumerate(info["tasks"]):
                    if plan is not None:
                        plan["l1"] = totals[name + L1][t].tolist()
            if info["rescale"] and (round_ == 2 or not _cuts(info)):
                self._factors(info, totals.get(name + L1_ABOVE))
        return state

    @staticmethod
    def _factors(info: dict[str, Any], above: torch.Tensor | None) -> None:
        """Driver: each task's L1 rescale factor, from delta's L1 and the kept L1."""
        import torch

        for t, plan in enumerate(info["tasks"]):
            if plan is None:
                continue
            before = torch.tensor(plan["l1"], dtype=torch.int64)
            if plan["a"] == plan["b"]:
                kept = torch.zeros_like(before)
            else:
                row = None if above is None else above[t]
                kept = _top_l1(plan, BOTTOM, before, row) - _top_l1(plan, TOP, before, row)
            plan["factor"] = dare.rescale_factor(before, kept)

    # -- map pass ----------------------------------------------------------------------

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        info = state["tensors"][chunk.tensor]
        b, deltas = combine.task_vectors(base, tasks)
        sparse = []
        for d, plan in zip(deltas, info["tasks"], strict=True):
            if plan is None:  # density >= 1: untouched, as in mergekit
                sparse.append(d)
                continue
            keep = keep_mask(topk.magnitude_keys(d), plan, chunk.start)
            sparse.append(dare.sparsify(d, keep, plan.get("factor")))
        return combine.combine(
            b, sparse, [float(w) for w in params["weight"]], consensus=self.consensus,
            normalize=bool(params["normalize"]), lambda_=float(params["lambda"]),
        )  # fmt: skip

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The rounds' histograms by TIES's fused kernel (`ties_numba.statistics`), once per
        cut row; None where L1 rescaling adds statistics the kernel does not compute."""
        round_, chunk, state = work.round_, work.chunk, work.state
        import numpy as np

        from ram_dist.kernels import ties_numba

        info = state["tensors"][chunk.tensor]
        if info["rescale"]:
            return None
        base, *tasks = inputs
        plans = info["tasks"]
        if round_ == 0:
            hist = ties_numba.statistics(base, tasks, ties_numba.HIGH, topk.HIGH_BINS)
            for t, plan in enumerate(plans):
                if plan is None or not any(plan["cuts"]):
                    hist[t] = 0  # as the eager round: no row for a task without a cut
            return {chunk.tensor: hist}, None
        kind, size = {
            1: (ties_numba.LOW, topk.LOW_BINS),
            2: (ties_numba.INDEX_HIGH, topk.index_bins(chunk.numel)),
            3: (ties_numba.INDEX_LOW, topk.LOW_BINS),
        }[round_]
        rows = []
        for which in (TOP, BOTTOM):
            select = []
            for plan in plans:
                c = None if plan is None else plan["cuts"][which]
                if c is None or (round_ > 1 and not _ordered(c)):
                    select.append((-1, -1))
                elif round_ == 1:
                    select.append((c["high_bin"], -1))
                else:
                    select.append((c["threshold"], c["index_bin"] if round_ == 3 else -1))
            rows.append(ties_numba.statistics(base, tasks, kind, size, select, chunk.start))
        return {chunk.tensor: np.stack(rows, axis=1)}, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` by TIES's merge kernel (`ties_numba.merge`), each task's kept set
        between its two cuts (`KEEP_BETWEEN`), written straight into `out`; False where L1
        rescaling multiplies by a factor the kernel does not apply."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        from ram_dist.kernels import ties_numba
        from ram_dist.methods.generalized_task_arithmetic.family import weight_sum

        info = state["tensors"][chunk.tensor]
        if info["rescale"]:
            return False
        keep, cuts = [], []
        for plan in info["tasks"]:
            if plan is None:  # density >= 1: untouched
                keep.append(ties_numba.KEEP_ALL)
                cuts.append((-1, -1))
                continue
            keep.append(ties_numba.KEEP_BETWEEN)
            top, bottom = plan["cuts"]
            if plan["a"] == plan["b"]:  # nothing kept (every delta times 0)
                cuts.append((ties_numba.NOTHING, -1, ties_numba.NOTHING, -1))
            else:
                cuts.append((*_bounds(bottom, True), *_bounds(top, False)))
        weights = [float(w) for w in params["weight"]]
        base, *tasks = inputs
        ties_numba.merge(
            base, tasks, out, weights=weights, keep=keep, cuts=cuts, start=chunk.start,
            consensus=self.consensus, normalize=bool(params["normalize"]),
            divisor=weight_sum(weights), lambda_=float(params["lambda"]), bf16_nan=bf16_nan,
        )  # fmt: skip
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk but L1 rescaling's."""
        return not (bool(params["rescale"]) and any(float(d) < 1 for d in params["density"]))

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """The count of cuts through equal magnitudes (where mergekit's choice is arbitrary)."""
        count = (report.get("breadcrumbs") or {}).get("cuts_through_equal_magnitudes")
        return [] if count is None else [f"breadcrumbs cuts through equal magnitudes: {count}"]

    def report(self, state: State) -> dict[str, Any]:
        ordered = sum(
            1 for info in state.get("tensors", {}).values() for *_, c in _cuts(info) if _ordered(c)
        )
        return {"breadcrumbs": {"cuts_through_equal_magnitudes": ordered}}


#: The members, with mergekit's names.
METHODS = (
    Breadcrumbs(
        "breadcrumbs", False, "Model Breadcrumbs",
        "Model Breadcrumbs: drop each task's largest and smallest changes, add up the rest",
    ),
    Breadcrumbs(
        "breadcrumbs_ties", True, "Model Breadcrumbs with TIES",
        "Model Breadcrumbs' two magnitude cuts, then TIES's sign election",
    ),
)  # fmt: skip
