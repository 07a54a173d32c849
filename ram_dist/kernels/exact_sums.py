"""The layout of exact sums of float32 products (`ram_dist.methods.exact_sums` says what they
are), and the fused path's kernels on numpy arrays: no torch, numba where installed.

A statistic is int64[BINS]: bins 1..2047+SPLIT by float64 exponent (a product's significand
split in two addends, the high one SPLIT bits up), then one bin each for +inf, -inf and NaN
products.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ram_dist import kernels

_SPLIT = 26
_EXPONENTS = 2048 + _SPLIT
_POS_INF, _NEG_INF, _NAN = _EXPONENTS, _EXPONENTS + 1, _EXPONENTS + 2
#: int64 bins in one exact sum.
BINS = _EXPONENTS + 3


def pairs_of(n: int) -> list[tuple[int, int]]:
    """Every pair (i, j), i <= j < n, in the order `gram` returns their sums."""
    return [(i, j) for i in range(n) for j in range(i, n)]


def gram(vectors: np.ndarray, pairs: Sequence[tuple[int, int]]) -> np.ndarray | None:
    """int64[len(pairs), BINS]: `product_sum(vectors[i], vectors[j])` for each pair, by the
    numba kernel, on float32 rows of equal length (no torch: the fused path's); None where
    numba is not installed (the eager rule then runs)."""
    kernel = kernels.numba_module("exact_sums_numba")
    if kernel is None:
        return None
    out = np.zeros((len(pairs), BINS), dtype=np.int64)
    index = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    kernel.gram(np.ascontiguousarray(vectors, np.float32), index, _SPLIT, _POS_INF, out)
    return out


def row_gram(vectors: np.ndarray, pairs: Sequence[tuple[int, int]], row: int) -> np.ndarray | None:
    """int64[rows, len(pairs), BINS]: `gram` of each whole row of `row` elements."""
    kernel = kernels.numba_module("exact_sums_numba")
    if kernel is None:
        return None
    out = np.zeros((vectors.shape[1] // row, len(pairs), BINS), dtype=np.int64)
    index = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    kernel.row_gram(np.ascontiguousarray(vectors, np.float32), index, row, _SPLIT, _POS_INF, out)
    return out
