"""TIES's exact magnitude cut over a whole tensor, computed chunk by chunk.

TIES keeps the k = max(1, int(density * numel)) largest |delta| of a whole tensor, ties at
the cut going to the lowest flat indices. No worker holds a whole tensor, so the cut is found
from int64 histograms that the driver sums, in up to four reduce rounds (numbered from 0,
as in the engine):

* Keys: the bits of float32 |delta| as an integer. For non-negative floats the bit pattern
  is monotonic in the value (NaN sorts above inf, as in torch's descending sort), and the
  sign bit is 0, so keys lie in [0, 2**31).
* Round 0, per (tensor, task): `high_histogram`, counts of `key >> 16` (32768 bins).
  The driver's `find_high_bin` finds the bin holding the k-th largest key and how many lie
  above that bin.
* Round 1: `low_histogram`, counts of `key & 0xFFFF` among keys in that bin (65536 bins).
  `find_cut` then knows the threshold key T exactly, `above = #(key > T)`,
  `need_at_threshold = k - above` and `equal_at_threshold = #(key == T)`.
* Rounds 2 and 3, only when `Cut.ordered` (the cut splits the group of keys equal to T):
  the same two-level search over the flat indices of the T-equal elements, lowest first.
  Round 2, `index_high_histogram`: counts of `index >> 16` (`index_bins(numel)` bins);
  `find_index_bin` picks the bin holding the `need_at_threshold`-th T-equal element.
  Round 3, `index_low_histogram`: counts of `index & 0xFFFF` in that bin (65536 bins);
  `find_index_cut` gives the exclusive cutoff `index_cut`: exactly `need_at_threshold`
  T-equal elements have a flat index below it.
* Map pass: `keep_mask` keeps `key > T | (key == T & index < index_cut)` (every T-equal
  element when there is no `index_cut`), a rule of each element alone, so the kept set
  cannot depend on chunking.

All counts are int64 integer sums, exact whatever the split, order or device. mergekit takes
`torch.argsort(descending=True)[:k]`, an unstable sort: its choice among equal magnitudes at
the cut is unspecified, so the two agree exactly only when the cut falls between distinct
magnitudes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


HIGH_BINS = 1 << 15
LOW_BINS = 1 << 16
_LOW_MASK = LOW_BINS - 1


def magnitude_keys(delta: torch.Tensor) -> torch.Tensor:
    """int64 keys, flat: the float32 bit pattern of |delta|, ordered like |delta|."""
    import torch

    return delta.to(torch.float32).abs().reshape(-1).view(torch.int32).to(torch.int64)


def kept_count(density: float, numel: int) -> int:
    """mergekit's k: at least one element of a non-empty tensor when 0 < density < 1."""
    return max(1, int(density * numel))


def high_histogram(keys: torch.Tensor) -> torch.Tensor:
    """Round 0 statistic: int64[32768], how many keys have each value of `key >> 16`."""
    import torch

    return torch.bincount(keys >> 16, minlength=HIGH_BINS).to(torch.int64)


def low_histogram(keys: torch.Tensor, high_bin: int) -> torch.Tensor:
    """Round 1 statistic: int64[65536], counts of `key & 0xFFFF` where `key >> 16 == high_bin`."""
    import torch

    inside = keys[(keys >> 16) == high_bin]
    return torch.bincount(inside & _LOW_MASK, minlength=LOW_BINS).to(torch.int64)


def index_bins(numel: int) -> int:
    """Length of the round 2 histogram of a tensor of `numel` elements: ceil(numel / 65536)."""
    return -(-numel // LOW_BINS)


def _equal_index(keys: torch.Tensor, threshold: int, start: int) -> torch.Tensor:
    """Flat indices in the tensor of a chunk's keys equal to the threshold (the chunk's first
    element has index `start`)."""
    import torch

    return torch.nonzero(keys == threshold).reshape(-1) + start


def index_high_histogram(
    keys: torch.Tensor, threshold: int, start: int, numel: int
) -> torch.Tensor:
    """Round 2 statistic: int64[index_bins(numel)], counts of `index >> 16` among the chunk's
    keys equal to the threshold; `start` is the chunk's first flat index, `numel` the
    tensor's size."""
    import torch

    if start < 0 or start + keys.numel() > numel:
        raise ValueError(f"chunk [{start}, {start + keys.numel()}) outside a tensor of {numel}")
    index = _equal_index(keys, threshold, start)
    return torch.bincount(index >> 16, minlength=index_bins(numel)).to(torch.int64)


def index_low_histogram(
    keys: torch.Tensor, threshold: int, start: int, index_bin: int
) -> torch.Tensor:
    """Round 3 statistic: int64[65536], counts of `index & 0xFFFF` among the chunk's keys
    equal to the threshold whose `index >> 16 == index_bin`."""
    import torch

    index = _equal_index(keys, threshold, start)
    inside = index[(index >> 16) == index_bin]
    return torch.bincount(inside & _LOW_MASK, minlength=LOW_BINS).to(torch.int64)


@dataclass(frozen=True)
class HighCut:
    """Driver, after round 0: the high bin holding the k-th largest key."""

    high_bin: int
    above: int
    """How many keys lie in higher bins (all of them kept)."""


@dataclass(frozen=True)
class Cut:
    """Driver, after round 1: keep key > threshold, and the first `need_at_threshold` keys
    equal to it in flat order."""

    threshold: int
    need_at_threshold: int
    equal_at_threshold: int

    @property
    def ordered(self) -> bool:
        """True when only some T-equal keys are kept, so rounds 2 and 3 (flat order) run."""
        return self.need_at_threshold < self.equal_at_threshold


@dataclass(frozen=True)
class IndexBin:
    """Driver, after round 2: the index bin holding the last kept T-equal element."""

    index_bin: int
    need_in_bin: int
    """How many T-equal elements of that bin are kept (those of lower bins all are)."""


def _first(hist: torch.Tensor, n: int) -> tuple[int, int]:
    """The first bin where the cumulative count reaches n (n >= 1), and the count before it."""
    import torch

    hist = hist.cpu()
    cum = hist.cumsum(0)
    b = int(torch.searchsorted(cum, n))
    if b == hist.numel():
        total = int(cum[-1]) if b else 0
        raise ValueError(f"cannot keep {n} elements of a histogram of {total}")
    return b, int(cum[b]) - int(hist[b])


def _find(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """The bin (from the top) where the cumulative count reaches k, and the count above it."""
    j, above = _first(hist.flip(0), k)
    return hist.numel() - 1 - j, above


def find_high_bin(hist: torch.Tensor, k: int) -> HighCut:
    """Driver: from the summed round 0 histogram of one (tensor, task)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    high_bin, above = _find(hist, k)
    return HighCut(high_bin=high_bin, above=above)


def find_cut(low_hist: torch.Tensor, high: HighCut, k: int) -> Cut:
    """Driver: from the summed round 1 histogram of the bin `high` names."""
    low, above_low = _find(low_hist, k - high.above)
    equal = int(low_hist[low])
    need = k - high.above - above_low
    return Cut(
        threshold=(high.high_bin << 16) | low, need_at_threshold=need, equal_at_threshold=equal
    )


def find_index_bin(hist: torch.Tensor, need_at_threshold: int) -> IndexBin:
    """Driver: from the summed round 2 histogram of one (tensor, task) whose `Cut.ordered`."""
    if need_at_threshold < 1:
        raise ValueError(f"need_at_threshold must be >= 1, got {need_at_threshold}")
    index_bin, before = _first(hist, need_at_threshold)
    return IndexBin(index_bin=index_bin, need_in_bin=need_at_threshold - before)


def find_index_cut(low_hist: torch.Tensor, found: IndexBin) -> int:
    """Driver: from the summed round 3 histogram of the bin `found` names, the exclusive
    flat-index cutoff of the kept T-equal elements."""
    low, _ = _first(low_hist, found.need_in_bin)
    return (found.index_bin << 16) + low + 1


def keep_mask(
    keys: torch.Tensor, threshold: int, start: int, index_cut: int | None
) -> torch.Tensor:
    """Map pass: bool mask of a chunk (first flat index `start`), `key > threshold`, or
    `key == threshold` and `index < index_cut` (None: every T-equal key is kept).

    A rule of each element alone: the masks of any chunking concatenate to the whole
    tensor's stable top-k.
    """
    if index_cut is None:
        return keys >= threshold
    keep = keys > threshold
    before = min(max(index_cut - start, 0), keys.numel())  # chunk elements below index_cut
    keep[:before] |= keys[:before] == threshold
    return keep
