"""TIES: magnitude sparsification per task, sign election, disjoint mean.

Per tensor and task, keep the k = max(1, int(density * numel)) largest |delta| (ties at the
cut: lowest flat index first), then `task_arithmetic.combine` with the sign election and
(default) normalization by the kept weights. mergekit's special cases are kept: density >= 1
leaves the delta untouched, density <= 0 gives zeros.

The cut needs whole-tensor statistics (`topk.py`): round 1 `high_histograms`, round 2
`low_histograms`, round 3 `equal_counts` when some tied keys at the cut are dropped. With
`rescale` (mergekit's L1 rule, off by default for TIES) round 1 also yields the L1 statistic
of delta (`dare.l1_statistic`) and round 3 that of the keys above the cut; the kept keys
equal to the cut all have the same value, so `kept_l1` adds them exactly on the driver.

Byte identity with mergekit holds unless the cut splits a group of equal non-zero
magnitudes (mergekit's unstable argsort picks arbitrarily among them; for zeros the choice
changes no byte, as a kept or dropped zero delta is the same zero) and, as for every
combine, for N <= 4 tasks (see `task_arithmetic`). With `rescale` the L1 factor may differ
by an ulp (see `dare`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ram_dist.methods.dare import l1_statistic, rescale_factor, sparsify
from ram_dist.methods.task_arithmetic import combine, task_vectors
from ram_dist.methods.topk import (
    Cut,
    equal_count,
    high_histogram,
    low_histogram,
    magnitude_keys,
    ties_keep_mask,
)


def needs_cut(density: float, numel: int) -> bool:
    """Whether a task's tensor is sparsified by magnitude at all (0 < density < 1)."""
    return 0 < density < 1 and numel > 0


def high_histograms(base: torch.Tensor, tasks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Round 1 statistics of a chunk: int64[N, 32768]."""
    _, deltas = task_vectors(base, tasks)
    return torch.stack([high_histogram(magnitude_keys(d)) for d in deltas])


def low_histograms(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], high_bins: Sequence[int]
) -> torch.Tensor:
    """Round 2 statistics of a chunk: int64[N, 65536], for each task's high bin."""
    _, deltas = task_vectors(base, tasks)
    return torch.stack(
        [low_histogram(magnitude_keys(d), h) for d, h in zip(deltas, high_bins, strict=True)]
    )


def equal_counts(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], thresholds: Sequence[int]
) -> torch.Tensor:
    """Round 3 statistics of a chunk: int64[N], keys equal to each task's threshold."""
    _, deltas = task_vectors(base, tasks)
    counts = [equal_count(magnitude_keys(d), t) for d, t in zip(deltas, thresholds, strict=True)]
    return torch.tensor(counts, dtype=torch.int64)


def l1_statistics(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], thresholds: Sequence[int] | None = None
) -> torch.Tensor:
    """int64[N, 256]: L1 statistic of each delta (round 1), or of keys > threshold (round 3)."""
    _, deltas = task_vectors(base, tasks)
    rows = []
    for t, delta in enumerate(deltas):
        flat = delta.reshape(-1)
        if thresholds is not None:
            flat = flat * (magnitude_keys(flat) > thresholds[t])
        rows.append(l1_statistic(flat))
    return torch.stack(rows)


def kept_l1(above: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Driver: the L1 statistic of the kept elements, from that of the keys above the cut."""
    value = torch.tensor([cut.threshold], dtype=torch.int32).view(torch.float32)
    return above + l1_statistic(value) * cut.need_at_threshold


def rescale_factors(
    totals: torch.Tensor, aboves: torch.Tensor, cuts: Sequence[Cut | None]
) -> list[float | None]:
    """Driver: per task the float32 L1 rescale factor (None: not sparsified or skipped)."""
    return [
        None if cut is None else rescale_factor(totals[t], kept_l1(aboves[t], cut))
        for t, cut in enumerate(cuts)
    ]


def sparsify_chunk(
    delta: torch.Tensor,
    density: float,
    cut: Cut | None,
    equal_before_chunk: int,
    factor: float | None = None,
) -> torch.Tensor:
    """mergekit's `magnitude` on one chunk, given the whole tensor's cut."""
    if density >= 1:
        return delta
    if cut is None:  # density <= 0 (or an empty tensor): mergekit returns zeros
        return torch.zeros_like(delta)
    keys = magnitude_keys(delta)
    keep = ties_keep_mask(keys, cut.threshold, cut.need_at_threshold, equal_before_chunk)
    return sparsify(delta, keep, factor)


def merge_chunk(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    densities: Sequence[float],
    cuts: Sequence[Cut | None],
    equal_before: Sequence[int],
    factors: Sequence[float | None] | None = None,
    normalize: bool = True,
    lambda_: float = 1.0,
) -> torch.Tensor:
    """Map pass of TIES on one chunk; returns the merged float32 values.

    `cuts[t]` is task t's `Cut` (None when `needs_cut` is false), `equal_before[t]` the
    chunk's count of earlier keys equal to the threshold (0 unless `cuts[t].ordered`),
    `factors` the L1 rescale factors when `rescale` is on.
    """
    b, deltas = task_vectors(base, tasks)
    factors = factors if factors is not None else [None] * len(deltas)
    sparse = [
        sparsify_chunk(d, density, cut, before, factor)
        for d, density, cut, before, factor in zip(
            deltas, densities, cuts, equal_before, factors, strict=True
        )
    ]
    return combine(b, sparse, weights, consensus=True, normalize=normalize, lambda_=lambda_)
