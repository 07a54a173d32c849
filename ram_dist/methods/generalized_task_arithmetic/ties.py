"""TIES: magnitude sparsification per task, sign election, disjoint mean.

Per tensor and task, keep the k = max(1, int(density * numel)) largest |delta| (ties at the
cut: lowest flat index first), then `combine.combine` with the sign election and
(default) normalization by the kept weights. mergekit's special cases are kept: density >= 1
leaves the delta untouched, density <= 0 gives zeros.

The engine runs it as `family.TaskArithmeticFamily` ("ties"), whose reduce rounds are the
functions here: per chunk, each task's histograms of the round (`chunk_statistics`, or
`fused_statistics` by the kernel), and on the driver the cut found from their sums
(`finalize`). The cut's rounds and its per-element keep rule are `topk.py`'s. With `rescale`
(mergekit's L1 rule, off by default for TIES) round 0 also yields the L1 statistic of delta
(`dare.l1_statistic`) and round 2 that of the keys above the cut; the kept keys equal to the
cut all have the same value, so `kept_l1` adds them exactly on the driver.

Byte identity with mergekit holds unless the cut splits a group of equal non-zero
magnitudes (mergekit's unstable argsort picks arbitrarily among them; for zeros the choice
changes no byte, as a kept or dropped zero delta is the same zero) and, as for every
combine, for N <= 4 tasks (see `combine`). With `rescale` the L1 factor may differ
by an ulp (see `dare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ram_dist.methods.generalized_task_arithmetic import combine, dare, topk
from ram_dist.methods.generalized_task_arithmetic.dare import l1_statistic
from ram_dist.methods.generalized_task_arithmetic.topk import Cut

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import Chunk

#: Keys of the L1 statistics (appended to the tensor's name): of each task vector (round 0)
#: and of its keys above the cut (round 2).
L1 = "#l1"
L1_ABOVE = "#l1-above"
#: One task's cut as the state holds it (None: the task is not cut).
TaskCut = dict[str, Any] | None


def needs_cut(density: float, numel: int) -> bool:
    """Whether a task's tensor is sparsified by magnitude at all (0 < density < 1)."""
    return 0 < density < 1 and numel > 0


def kept_l1(above: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Driver: the L1 statistic of the kept elements, from that of the keys above the cut."""
    import torch

    value = torch.tensor([cut.threshold], dtype=torch.int32).view(torch.float32)
    return above + l1_statistic(value) * cut.need_at_threshold


def ordered(cut: TaskCut) -> bool:
    """Whether TIES needs the flat-index rounds (2 and 3) for this cut: only when it splits
    a group of equal non-zero magnitudes. At magnitude zero every zero is kept: which zeros
    a top-k keeps changes no byte (a kept or a dropped +-0 delta is the same +-0, and adds
    nothing to an L1 norm), so the two rounds would read every input twice for nothing."""
    return cut is not None and cut["need"] < cut["equal"] and cut["threshold"] != 0


def fused_statistics(
    round_: int, chunk: Chunk, inputs: Sequence[np.ndarray], cuts: list[TaskCut]
) -> np.ndarray:
    """The TIES round's histograms (no L1 statistics) by the fused kernel."""
    from ram_dist.kernels import ties_numba

    base, *tasks = inputs
    if round_ == 0:
        return ties_numba.statistics(base, tasks, ties_numba.HIGH, topk.HIGH_BINS)
    if round_ == 1:
        select = [(c["high_bin"], -1) if c else (-1, -1) for c in cuts]
        return ties_numba.statistics(base, tasks, ties_numba.LOW, topk.LOW_BINS, select)
    if round_ == 2:
        select = [(c["threshold"], -1) if ordered(c) else (-1, -1) for c in cuts]
        size = topk.index_bins(chunk.numel)
        kind = ties_numba.INDEX_HIGH
    else:
        select = [(c["threshold"], c["index_bin"]) if ordered(c) else (-1, -1) for c in cuts]
        size, kind = topk.LOW_BINS, ties_numba.INDEX_LOW
    return ties_numba.statistics(base, tasks, kind, size, select, chunk.start)


def chunk_statistics(
    round_: int, chunk: Chunk, base: torch.Tensor, tasks: list[torch.Tensor], info: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A chunk's statistics of TIES's round `round_`, one row per task (`info`: the tensor's
    state: its tasks' cuts so far, and whether L1 rescaling runs)."""
    import torch

    _, deltas = combine.task_vectors(base, tasks)
    keys = [topk.magnitude_keys(d) for d in deltas]
    if round_ == 0:
        out = {chunk.tensor: torch.stack([topk.high_histogram(k) for k in keys])}
        if info["rescale"]:
            out[chunk.tensor + L1] = torch.stack([dare.l1_statistic(d) for d in deltas])
        return out
    if round_ == 1:
        rows = [
            topk.low_histogram(k, c["high_bin"]) if c else _zeros(topk.LOW_BINS, k.device)
            for k, c in zip(keys, info["cuts"], strict=True)
        ]
        return {chunk.tensor: torch.stack(rows)}
    rows = []
    for k, c in zip(keys, info["cuts"], strict=True):
        if not ordered(c):  # no index cut: a zero row
            size = topk.index_bins(chunk.numel) if round_ == 2 else topk.LOW_BINS
            rows.append(_zeros(size, k.device))
        elif round_ == 2:
            row = topk.index_high_histogram(k, c["threshold"], chunk.start, chunk.numel)
            rows.append(row)
        else:
            row = topk.index_low_histogram(k, c["threshold"], chunk.start, c["index_bin"])
            rows.append(row)
    out = {chunk.tensor: torch.stack(rows)}
    if round_ == 2 and info["rescale"]:
        out[chunk.tensor + L1_ABOVE] = torch.stack(
            [
                dare.l1_statistic(d.reshape(-1) * (k > c["threshold"]))
                if c
                else _zeros(dare.L1_BINS, k.device)
                for k, d, c in zip(keys, deltas, info["cuts"], strict=True)
            ]
        )
    return out


def finalize(
    round_: int, name: str, totals: dict[str, torch.Tensor], cuts: list[TaskCut], rescale_eps: float
) -> None:
    """Driver: what the summed statistics of round `round_` tell of tensor `name`'s cuts,
    written into them (the high bin, then the threshold, then the flat-index cut where the
    threshold splits equal magnitudes; with L1 rescaling, each task's factor)."""
    import torch

    total = totals[name]
    for t, cut in enumerate(cuts):
        if cut is None:
            continue
        if round_ == 0:
            high = topk.find_high_bin(total[t], cut["k"])
            cut.update(high_bin=high.high_bin, above=high.above)
            if name + L1 in totals:
                cut["l1"] = totals[name + L1][t].tolist()
        elif round_ == 1:
            high = topk.HighCut(cut["high_bin"], cut["above"])
            found = topk.find_cut(total[t], high, cut["k"])
            cut.update(threshold=found.threshold, need=found.need_at_threshold)
            cut["equal"] = found.equal_at_threshold
        elif ordered(cut) and round_ == 2:
            found_bin = topk.find_index_bin(total[t], cut["need"])
            cut.update(index_bin=found_bin.index_bin, need_in_bin=found_bin.need_in_bin)
        elif ordered(cut) and round_ == 3:
            found_bin = topk.IndexBin(cut["index_bin"], cut["need_in_bin"])
            cut["index_cut"] = topk.find_index_cut(total[t], found_bin)
        if round_ == 2 and name + L1_ABOVE in totals:
            found = topk.Cut(cut["threshold"], cut["need"], cut["equal"])
            above = totals[name + L1_ABOVE][t]
            before = torch.tensor(cut["l1"], dtype=torch.int64)
            kept = kept_l1(above, found)
            cut["factor"] = dare.rescale_factor(before, kept, rescale_eps)


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    import torch

    return torch.zeros(n, dtype=torch.int64, device=device)
