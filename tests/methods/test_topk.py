"""The chunked top-k cut equals a whole-tensor stable top-k, for any chunking."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from ram_dist.methods.generalized_task_arithmetic.topk import (
    HIGH_BINS,
    LOW_BINS,
    find_cut,
    find_high_bin,
    find_index_bin,
    find_index_cut,
    high_histogram,
    index_bins,
    index_high_histogram,
    index_low_histogram,
    keep_mask,
    kept_count,
    low_histogram,
    magnitude_keys,
)


def reference_mask(values: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest |x|, ties by lowest flat index: a stable sort by (-|x|, index)."""
    flat = values.reshape(-1).abs()
    order = torch.sort(flat, descending=True, stable=True).indices
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def _total(stats: Iterable[torch.Tensor]) -> torch.Tensor:
    """The driver's sum of per-chunk statistics."""
    it = iter(stats)
    total = next(it).clone()
    for stat in it:
        total += stat
    return total


def chunked_mask(values: torch.Tensor, k: int, bounds: list[int]) -> torch.Tensor:
    """What the engine does: up to four reduce rounds over chunks, then a map pass."""
    keys = magnitude_keys(values)
    n = keys.numel()
    chunks = [(lo, keys[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    high = find_high_bin(_total(high_histogram(c) for _, c in chunks), k)
    cut = find_cut(_total(low_histogram(c, high.high_bin) for _, c in chunks), high, k)
    index_cut = None
    if cut.ordered:
        t = cut.threshold
        found = find_index_bin(
            _total(index_high_histogram(c, t, lo, n) for lo, c in chunks), cut.need_at_threshold
        )
        low = _total(index_low_histogram(c, t, lo, found.index_bin) for lo, c in chunks)
        index_cut = find_index_cut(low, found)
        # exactly need_at_threshold T-equal elements lie below the cut, the last just below it
        equal = keys == t
        assert int(equal[:index_cut].sum()) == cut.need_at_threshold
        assert bool(equal[index_cut - 1])
    return torch.cat([keep_mask(c, cut.threshold, lo, index_cut) for lo, c in chunks])


def chunkings(n: int, gen: torch.Generator) -> list[list[int]]:
    random_cuts = sorted(set(torch.randint(1, max(n, 2), (7,), generator=gen).tolist()))
    return [
        [0, n],
        list(range(n)) + [n] if n <= 300 else [0, 1, 2, n - 1, n],
        [0, *[c for c in random_cuts if c < n], n],
        list(range(0, n, 97)) + [n],
    ]


def _check(values: torch.Tensor, k: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    ref = reference_mask(values, k)
    assert int(ref.sum()) == k
    for bounds in chunkings(values.numel(), gen):
        got = chunked_mask(values, k, sorted(set(bounds)))
        assert torch.equal(got, ref), bounds


@pytest.mark.parametrize("density", [0.001, 0.1, 0.3, 0.5, 0.7, 0.999])
def test_random_values(density: float) -> None:
    values = torch.randn(3001, generator=torch.Generator().manual_seed(1))
    _check(values, kept_count(density, values.numel()))


@pytest.mark.parametrize("k", [1, 2, 17, 150, 299, 300])
def test_many_equal_magnitudes_at_the_cut(k: int) -> None:
    gen = torch.Generator().manual_seed(2)
    levels = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0])
    values = levels[torch.randint(0, 6, (300,), generator=gen)]
    _check(values, k)


def test_k_one_and_all() -> None:
    values = torch.randn(257, generator=torch.Generator().manual_seed(3))
    _check(values, 1)
    _check(values, values.numel())
    assert kept_count(0.0001, 257) == 1


def test_zeros_and_signed_zeros() -> None:
    values = torch.zeros(200)
    values[::3] = -0.0
    for k in (1, 50, 200):
        _check(values, k)


def test_same_bin_different_low_bits_and_specials() -> None:
    # Values within one high bin (same top 16 bits) and inf/nan above everything.
    base = torch.tensor([1.0]).view(torch.int32)
    values = (base + torch.arange(0, 4000, 7, dtype=torch.int32)).view(torch.float32)
    values = torch.cat([values, values[:50], torch.tensor([float("inf"), float("nan"), 3e-45])])
    for k in (1, 2, 3, 60, 400, values.numel()):
        _check(values, k)


def _around_index_bins(n: int) -> list[int]:
    """Bounds with 1-element chunks at and around every multiple of 65536 below n."""
    edges = [m + d for m in range(LOW_BINS, n, LOW_BINS) for d in (-2, -1, 0, 1, 2)]
    return [0, *edges, n]


@pytest.mark.parametrize("k", [1, 40_000, 65_535, 100_001, 196_000])
def test_equal_magnitudes_spanning_several_index_bins(k: int) -> None:
    """T-equal elements spread over 4 index bins: the cut can land in any of them."""
    n = 3 * LOW_BINS + 1234
    gen = torch.Generator().manual_seed(4)
    levels = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0])
    values = levels[torch.randint(0, 5, (n,), generator=gen)]
    ref = reference_mask(values, k)
    random_cuts = sorted(set(torch.randint(1, n, (9,), generator=gen).tolist()))
    for bounds in ([0, n], _around_index_bins(n), [0, *random_cuts, n], [*range(0, n, 65_521), n]):
        assert torch.equal(chunked_mask(values, k, bounds), ref), bounds[:8]


@pytest.mark.parametrize("k", [1, LOW_BINS - 1, LOW_BINS, LOW_BINS + 1, 2 * LOW_BINS, 3 * LOW_BINS])
def test_all_equal_cut_at_index_bin_edges(k: int) -> None:
    """Every element equal: the index cut is k itself, on either side of a bin edge."""
    n = 3 * LOW_BINS + 3
    values = torch.full((n,), -0.25)
    ref = reference_mask(values, k)
    assert int(ref.sum()) == k and bool(ref[:k].all())
    for bounds in ([0, n], _around_index_bins(n), [0, k - 1, k, k + 1, n]):
        assert torch.equal(chunked_mask(values, k, sorted(set(bounds))), ref), bounds[:8]


def test_statistic_shapes_and_errors() -> None:
    keys = magnitude_keys(torch.randn(10))
    assert high_histogram(keys).shape == (HIGH_BINS,) and high_histogram(keys).dtype == torch.int64
    assert low_histogram(keys, 0).shape == (LOW_BINS,)
    with pytest.raises(ValueError, match=r"^cannot keep 11 elements of a histogram of 10$"):
        find_high_bin(high_histogram(keys), 11)
    with pytest.raises(ValueError, match=r"^k must be >= 1, got 0$"):
        find_high_bin(high_histogram(keys), 0)


def test_index_statistics_shapes_and_errors() -> None:
    assert [index_bins(n) for n in (1, LOW_BINS, LOW_BINS + 1, 5 * LOW_BINS)] == [1, 1, 2, 5]
    keys = magnitude_keys(torch.tensor([1.0, -2.0, 1.0, 0.0, -1.0]))
    t = int(keys[0])
    high = index_high_histogram(keys, t, 3 * LOW_BINS - 2, 3 * LOW_BINS + 3)
    assert high.dtype == torch.int64 and high.tolist() == [0, 0, 1, 2]
    low = index_low_histogram(keys, t, 3 * LOW_BINS - 2, 3)
    assert low.shape == (LOW_BINS,) and low.dtype == torch.int64
    assert torch.nonzero(low).reshape(-1).tolist() == [0, 2] and int(low.sum()) == 2
    past = rf"^chunk \[{3 * LOW_BINS}, {3 * LOW_BINS + 5}\) outside a tensor of {3 * LOW_BINS + 3}$"
    with pytest.raises(ValueError, match=past):  # the chunk ends past the tensor
        index_high_histogram(keys, t, 3 * LOW_BINS, 3 * LOW_BINS + 3)
    with pytest.raises(ValueError, match=r"^chunk \[-1, 4\) outside a tensor of 100$"):
        index_high_histogram(keys, t, -1, 100)
    found = find_index_bin(high, 2)
    assert (found.index_bin, found.need_in_bin) == (3, 1)
    assert find_index_cut(low, found) == 3 * LOW_BINS + 1
    for need, message in [(0, "need_at_threshold must be >= 1, got 0"),
                          (4, "cannot keep 4 elements of a histogram of 3")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"^{message}$"):
            find_index_bin(high, need)
    with pytest.raises(ValueError, match=r"^cannot keep 3 elements of a histogram of 2$"):
        find_index_cut(low, type(found)(3, 3))
    # without an index cut every T-equal key is kept; with one, only those below it
    assert keep_mask(keys, t, 0, None).tolist() == [True, True, True, False, True]
    assert keep_mask(keys, t, 0, 3).tolist() == [True, True, True, False, False]
    assert keep_mask(keys, t, 10, 3).tolist() == [False, True, False, False, False]
    assert keep_mask(keys, t, 0, 0).tolist() == [False, True, False, False, False]
