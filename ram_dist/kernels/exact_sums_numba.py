"""Exact sums of float32 products (numba), bin for bin `methods.exact_sums`' torch rule:
each product is formed in float64 (exact), and its integer significand is split into two
addends of `split` bits or fewer, added to the int64 bins of its exponent (the layout, the
bins for infinities and NaN included, is `methods.exact_sums`'; this kernel takes it as
arguments). Products go a tile at a time through a float64 scratch whose bits are read as
int64, so no float is ever rounded here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import OPTIONS

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Products formed at once in the float64 scratch.
TILE = 512
_FRAC = (1 << 52) - 1


@njit(cache=True, **OPTIONS)
def _add_products(products, bins, split, special):  # noqa: ANN001, ANN201  (numba arrays)
    """Add each float64 product's two addends (or its special count) to `bins`."""
    low_mask = (np.int64(1) << split) - 1
    raw = products.view(np.int64)
    for t in range(raw.size):
        b = raw[t]
        exponent = (b >> 52) & 0x7FF
        frac = b & _FRAC
        if exponent == 0x7FF:
            if frac != 0:
                bins[special + 2] += 1
            elif b < 0:
                bins[special + 1] += 1
            else:
                bins[special] += 1
            continue
        sig = frac | (np.int64(1) << 52) if exponent > 0 else frac
        position = exponent if exponent > 0 else 1
        low = sig & low_mask
        high = sig >> split
        if b < 0:
            low = -low
            high = -high
        bins[position] += low
        bins[position + split] += high


@njit(cache=True, **OPTIONS)
def gram(stack, pairs, split, special, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[k] += bins of sum_e stack[i, e] * stack[j, e]` for each pair `(i, j) = pairs[k]`
    (float32 rows of `stack`)."""
    n = stack.shape[1]
    scratch = np.empty(TILE, dtype=np.float64)
    for lo in range(0, n, TILE):
        w = min(TILE, n - lo)
        for k in range(pairs.shape[0]):
            i, j = pairs[k, 0], pairs[k, 1]
            for t in range(w):
                scratch[t] = np.float64(stack[i, lo + t]) * np.float64(stack[j, lo + t])
            _add_products(scratch[:w], out[k], split, special)


@njit(cache=True, **OPTIONS)
def row_gram(stack, pairs, row, split, special, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`gram` per row of `row` elements: `out[r, k]` for the r-th whole row of `stack`."""
    scratch = np.empty(TILE, dtype=np.float64)
    for r in range(stack.shape[1] // row):
        for lo in range(r * row, (r + 1) * row, TILE):
            w = min(TILE, (r + 1) * row - lo)
            for k in range(pairs.shape[0]):
                i, j = pairs[k, 0], pairs[k, 1]
                for t in range(w):
                    scratch[t] = np.float64(stack[i, lo + t]) * np.float64(stack[j, lo + t])
                _add_products(scratch[:w], out[r, k], split, special)
