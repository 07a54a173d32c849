"""The chunked top-k cut equals a whole-tensor stable top-k, for any chunking."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from ram_dist.methods.topk import (
    HIGH_BINS,
    LOW_BINS,
    equal_before,
    equal_count,
    find_cut,
    find_high_bin,
    high_histogram,
    kept_count,
    low_histogram,
    magnitude_keys,
    ties_keep_mask,
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
    """What the engine does: three reduce rounds over chunks, then a map pass."""
    keys = magnitude_keys(values)
    chunks = [keys[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
    high = find_high_bin(_total(high_histogram(c) for c in chunks), k)
    cut = find_cut(_total(low_histogram(c, high.high_bin) for c in chunks), high, k)
    before = [0] * len(chunks)
    if cut.ordered:
        before = equal_before([equal_count(c, cut.threshold) for c in chunks])
    masks = [
        ties_keep_mask(c, cut.threshold, cut.need_at_threshold, b)
        for c, b in zip(chunks, before, strict=True)
    ]
    return torch.cat(masks)


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


def test_statistic_shapes_and_errors() -> None:
    keys = magnitude_keys(torch.randn(10))
    assert high_histogram(keys).shape == (HIGH_BINS,) and high_histogram(keys).dtype == torch.int64
    assert low_histogram(keys, 0).shape == (LOW_BINS,)
    with pytest.raises(ValueError):
        find_high_bin(high_histogram(keys), 11)
    with pytest.raises(ValueError):
        find_high_bin(high_histogram(keys), 0)
