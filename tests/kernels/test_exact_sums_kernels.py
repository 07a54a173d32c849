"""The numba exact sums (`kernels.exact_sums`) give the eager rule's bins, bin for bin:
whole vectors and per row, with subnormals, zeros, infinities and NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ram_dist.methods import exact_sums

pytest.importorskip("numba")

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _stack(n: int, rows: int = 3) -> np.ndarray:
    g = torch.Generator().manual_seed(n)
    scale = torch.exp2(torch.randint(-140, 120, (rows, n), generator=g).float())
    x = torch.randn(rows, n, generator=g) * scale
    x[0, 5] = math.inf
    x[1, 9] = -math.inf
    x[2, 11] = math.nan
    x[1, 13] = 1e-45
    x[:, 17] = 0.0
    return x.numpy().astype(np.float32)


@pytest.mark.parametrize("n", [1, 511, 512, 1500])
def test_gram_is_the_eager_rules_bins(n):
    if n < 20:
        stack = np.array([[2.5], [-3.0], [1e-40]], dtype=np.float32)
    else:
        stack = _stack(n)
    pairs = exact_sums.pairs_of(3)
    got = exact_sums.gram(stack, pairs)
    for (i, j), bins in zip(pairs, got, strict=True):
        want = exact_sums.product_sum(torch.from_numpy(stack[i]), torch.from_numpy(stack[j]))
        assert np.array_equal(bins, want.numpy()), (i, j)


def test_row_gram_is_gram_of_each_row():
    stack = _stack(3 * 700)
    pairs = [(0, 1), (2, 2)]
    got = exact_sums.row_gram(stack, pairs, 700)
    assert got.shape == (3, 2, exact_sums.BINS)
    for r in range(3):
        rows = stack[:, r * 700 : (r + 1) * 700]
        assert np.array_equal(got[r], exact_sums.gram(rows, pairs))
