"""TIES's exact magnitude cut over a whole tensor, computed chunk by chunk.

TIES keeps the k = max(1, int(density * numel)) largest |delta| of a whole tensor. No worker
holds a whole tensor, so the cut is found from int64 histograms that the driver sums:

* Keys: the bits of float32 |delta| as an integer. For non-negative floats the bit pattern
  is monotonic in the value (NaN sorts above inf, as in torch's descending sort), and the
  sign bit is 0, so keys lie in [0, 2**31).
* Round 1, per (tensor, task): `high_histogram`, counts of `key >> 16` (32768 bins).
  The driver's `find_high_bin` finds the bin holding the k-th largest key and how many lie
  above that bin.
* Round 2: `low_histogram`, counts of `key & 0xFFFF` among keys in that bin (65536 bins).
  `find_cut` then knows the threshold key T exactly, `above = #(key > T)`,
  `need_at_threshold = k - above` and `equal_at_threshold = #(key == T)`.
* Round 3, only when `Cut.ordered` (fewer T-equal elements are kept than exist): per chunk
  `equal_count`, not summed but kept in flat order; `equal_before` turns them into each
  chunk's number of T-equal elements before it. Ties at the cut go to the lowest flat
  indices, so the kept set cannot depend on chunking.
* Map pass: `ties_keep_mask` keeps key > T, and key == T when the element's global rank among
  T-equal elements is below `need_at_threshold`.

All counts are int64 integer sums, exact whatever the split, order or device. mergekit takes
`torch.argsort(descending=True)[:k]`, an unstable sort: its choice among equal magnitudes at
the cut is unspecified, so the two agree exactly only when the cut falls between distinct
magnitudes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

HIGH_BINS = 1 << 15
LOW_BINS = 1 << 16
_LOW_MASK = LOW_BINS - 1


def magnitude_keys(delta: torch.Tensor) -> torch.Tensor:
    """int64 keys, flat: the float32 bit pattern of |delta|, ordered like |delta|."""
    return delta.to(torch.float32).abs().reshape(-1).view(torch.int32).to(torch.int64)


def kept_count(density: float, numel: int) -> int:
    """mergekit's k: at least one element of a non-empty tensor when 0 < density < 1."""
    return max(1, int(density * numel))


def high_histogram(keys: torch.Tensor) -> torch.Tensor:
    """Round 1 statistic: int64[32768], how many keys have each value of `key >> 16`."""
    return torch.bincount(keys >> 16, minlength=HIGH_BINS).to(torch.int64)


def low_histogram(keys: torch.Tensor, high_bin: int) -> torch.Tensor:
    """Round 2 statistic: int64[65536], counts of `key & 0xFFFF` where `key >> 16 == high_bin`."""
    inside = keys[(keys >> 16) == high_bin]
    return torch.bincount(inside & _LOW_MASK, minlength=LOW_BINS).to(torch.int64)


@dataclass(frozen=True)
class HighCut:
    """Driver, after round 1: the high bin holding the k-th largest key."""

    high_bin: int
    above: int
    """How many keys lie in higher bins (all of them kept)."""


@dataclass(frozen=True)
class Cut:
    """Driver, after round 2: keep key > threshold, and the first `need_at_threshold` keys
    equal to it in flat order."""

    threshold: int
    need_at_threshold: int
    equal_at_threshold: int

    @property
    def ordered(self) -> bool:
        """True when only some T-equal keys are kept, so round 3 (flat order) is needed."""
        return self.need_at_threshold < self.equal_at_threshold


def _find(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """The bin (from the top) where the cumulative count reaches k, and the count above it."""
    hist = hist.cpu()
    from_top = hist.flip(0).cumsum(0)  # from_top[j]: keys in bins >= len - 1 - j
    j = int(torch.searchsorted(from_top, k))
    if j == hist.numel():
        raise ValueError(f"cannot keep {k} elements of a tensor with {int(from_top[-1])}")
    b = hist.numel() - 1 - j
    return b, int(from_top[j]) - int(hist[b])


def find_high_bin(hist: torch.Tensor, k: int) -> HighCut:
    """Driver: from the summed round 1 histogram of one (tensor, task)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    high_bin, above = _find(hist, k)
    return HighCut(high_bin=high_bin, above=above)


def find_cut(low_hist: torch.Tensor, high: HighCut, k: int) -> Cut:
    """Driver: from the summed round 2 histogram of the bin `high` names."""
    low, above_low = _find(low_hist, k - high.above)
    equal = int(low_hist[low])
    need = k - high.above - above_low
    return Cut(
        threshold=(high.high_bin << 16) | low, need_at_threshold=need, equal_at_threshold=equal
    )


def equal_count(keys: torch.Tensor, threshold: int) -> int:
    """Round 3 statistic of one chunk: how many of its keys equal the threshold."""
    return int((keys == threshold).sum())


def equal_before(counts: Sequence[int]) -> list[int]:
    """Driver: per chunk (chunks in flat order), how many T-equal keys precede it."""
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def ties_keep_mask(
    keys: torch.Tensor, threshold: int, need_at_threshold: int, equal_before_chunk: int
) -> torch.Tensor:
    """Map pass: bool mask of a chunk, identical to the whole-tensor stable top-k."""
    keep = keys > threshold
    if need_at_threshold <= equal_before_chunk:
        return keep  # every kept T-equal key lies in earlier chunks
    equal = keys == threshold
    rank = torch.cumsum(equal, dim=0) + (equal_before_chunk - 1)
    return keep | (equal & (rank < need_at_threshold))
