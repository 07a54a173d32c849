"""Exact sums of float32 products (numba), bin for bin `methods.exact_sums`' torch rule:
each product is formed in float64 (exact), and its integer significand is split into two
addends of `split` bits or fewer, added to the int64 bins of its exponent (the layout, the
bins for infinities and NaN included, is `methods.exact_sums`'; this kernel takes it as
arguments). No float is ever rounded here.

The work goes a tile of `TILE` elements at a time: each row is widened to float64 once, then
per pair of rows, in two steps:

* vectorized (straight-line uint64 code without branches, which LLVM turns into SIMD): each
  product's float64 bits give its row of a scratch histogram, 2 * exponent + sign (a
  negative product counts in a row of its own, subtracted at the end, so no sign is applied
  per product), and its addends;
* scalar: one add per addend into that row, in one of `LANES` blocks taken in turn, so that
  consecutive products of one exponent (most are, in a weight matrix) do not wait on each
  other's store.

A product whose significand has at most `53 - split` bits has a zero low addend and is added
as one addend, its high one: a tile takes that path for a pair of rows when the significant
bits of the two rows' widest values add up to no more (bfloat16 x bfloat16 is 16 bits,
float16 x float16 22). The scratch's rows are zeroed when a sum first reaches their exponent
(bounded from the inputs' exponents) and folded into the bins once per sum (`gram`) or per
row (`row_gram`). A tile whose rows hold an infinity or NaN goes product by product instead
(`_add_products`, the scalar binning this replaced). `python -m benchmarks.bench_kernels
--exact-sums` times both.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, bits64

if TYPE_CHECKING:
    from ram_dist.kernels.warm import Call

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Elements per tile: the float64 copies of the rows and the products' keys stay in L1/L2.
TILE = 1024
#: Scratch blocks per addend, taken in turn by consecutive products (independent stores).
LANES = 4
_ROWS = 4096  # 2 * exponent + sign of a float64
#: Scratch slots per block: a row's slots in two blocks must not lie a multiple of 4 KiB
#: apart (the CPU would take the second load for one of the first store, "4K aliasing").
_BLOCK = _ROWS + 24
_FRAC = (1 << 52) - 1
_U64 = np.uint64
_U32 = np.uint32


@njit(cache=True, **OPTIONS)
def _add_products(products, bins, split, special):  # noqa: ANN001, ANN201  (numba arrays)
    """Add each float64 product's two addends (or its special count) to `bins`: product by
    product, for tiles with an infinity or NaN."""
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
def _widen(src, bits, dst):  # noqa: ANN001, ANN201  (numba arrays)
    """dst[:] = float64 of the float32 values src[:] (`bits`, their uint32 view), and what
    bounds their products: the OR of their fraction bits, their largest exponent field, and
    the smallest of a non-zero value (255 where there is none)."""
    frac, largest, smallest = _U32(0), _U32(0), _U32(255)
    for t in range(bits.size):
        dst[t] = np.float64(src[t])
        magnitude = bits[t] & _U32(0x7FFFFFFF)
        field = magnitude >> _U32(23)
        nonzero = field if magnitude != _U32(0) else _U32(255)
        frac |= magnitude
        largest = largest if largest > field else field
        smallest = smallest if smallest < nonzero else nonzero
    return frac & _U32(0x7FFFFF), largest, smallest


@njit(cache=True, **OPTIONS)
def _significant_bits(frac):  # noqa: ANN001, ANN201
    """Significant bits of the widest float32 significand whose fraction bits OR to `frac`:
    24 less the trailing zeros of `frac` with the hidden bit."""
    v = frac | _U32(0x800000)
    zeros = 0
    while (v & _U32(1)) == _U32(0):
        v >>= _U32(1)
        zeros += 1
    return 24 - zeros


@njit(cache=True, **OPTIONS)
def _keys(a, b, split, row, low, high):  # noqa: ANN001, ANN201  (numba arrays)
    """Per product a[t] * b[t] (float64, exact): its scratch row, 2 * exponent + sign (a
    negative product's row beside the positive one, not a multiple of 4 KiB away), and its
    two addends, of its magnitude. A zero product lands in row 0 or 1, with addends never
    read."""
    s = _U64(split)
    low_mask = (_U64(1) << s) - _U64(1)
    high_mask = (_U64(1) << (_U64(52) - s)) - _U64(1)
    hidden = _U64(1) << (_U64(52) - s)
    for t in range(row.size):
        x = bits64(a[t] * b[t])
        row[t] = ((x >> _U64(51)) & _U64(0xFFE)) | (x >> _U64(63))
        low[t] = x & low_mask
        high[t] = ((x >> s) & high_mask) | hidden


@njit(cache=True, **OPTIONS)
def _keys_one(a, b, split, row, high):  # noqa: ANN001, ANN201  (numba arrays)
    """`_keys` of products whose low addend is zero: the row and the high addend only."""
    s = _U64(split)
    high_mask = (_U64(1) << (_U64(52) - s)) - _U64(1)
    hidden = _U64(1) << (_U64(52) - s)
    for t in range(row.size):
        x = bits64(a[t] * b[t])
        row[t] = ((x >> _U64(51)) & _U64(0xFFE)) | (x >> _U64(63))
        high[t] = ((x >> s) & high_mask) | hidden


@njit(cache=True, **OPTIONS)
def _scatter(row, low, high, n, scratch):  # noqa: ANN001, ANN201  (numba arrays)
    """Add the first n products' addends to their rows of the scratch: product t's low
    addend in block t % LANES, its high one in block LANES + t % LANES."""
    whole = n - n % LANES
    for t in range(0, whole, LANES):
        for lane in range(LANES):
            r = row[t + lane]
            scratch[r + _U64(lane * _BLOCK)] += low[t + lane]
            scratch[r + _U64((LANES + lane) * _BLOCK)] += high[t + lane]
    for t in range(whole, n):
        scratch[row[t]] += low[t]
        scratch[row[t] + _U64(LANES * _BLOCK)] += high[t]


@njit(cache=True, **OPTIONS)
def _scatter_one(row, high, n, scratch):  # noqa: ANN001, ANN201  (numba arrays)
    """`_scatter` of the high addends only (products whose low addend is zero)."""
    whole = n - n % LANES
    for t in range(0, whole, LANES):
        for lane in range(LANES):
            scratch[row[t + lane] + _U64((LANES + lane) * _BLOCK)] += high[t + lane]
    for t in range(whole, n):
        scratch[row[t] + _U64(LANES * _BLOCK)] += high[t]


@njit(cache=True, **OPTIONS)
def _clear(scratch, lowest, highest):  # noqa: ANN001, ANN201  (numba arrays)
    """Zero the rows of exponents [lowest, highest], positive and negative, in every block."""
    for block in range(2 * LANES):
        at = block * _BLOCK
        scratch[at + 2 * lowest : at + 2 * highest + 2] = 0


@njit(cache=True, **OPTIONS)
def _claim(scratch, bounds, lowest, highest):  # noqa: ANN001, ANN201  (numba arrays)
    """Widen `bounds` (a pair's exponents in use) to [lowest, highest], zeroing the rows it
    gains: the scratch is not zeroed up front, only the rows a sum reaches."""
    if bounds[0] > bounds[1]:
        _clear(scratch, lowest, highest)
        bounds[0], bounds[1] = lowest, highest
        return
    if lowest < bounds[0]:
        _clear(scratch, lowest, bounds[0] - 1)
        bounds[0] = lowest
    if highest > bounds[1]:
        _clear(scratch, bounds[1] + 1, highest)
        bounds[1] = highest


@njit(cache=True, **OPTIONS)
def _fold(scratch, lowest, highest, split, bins):  # noqa: ANN001, ANN201  (numba arrays)
    """bins[e] += the low addends of exponent e, bins[e + split] += its high ones, for e in
    [lowest, highest] (positive rows less negative rows, over the blocks)."""
    for e in range(lowest, highest + 1):
        low, high = np.int64(0), np.int64(0)
        for lane in range(LANES):
            at, up = lane * _BLOCK + 2 * e, (LANES + lane) * _BLOCK + 2 * e
            low += np.int64(scratch[at]) - np.int64(scratch[at + 1])
            high += np.int64(scratch[up]) - np.int64(scratch[up + 1])
        bins[e] += low
        bins[e + split] += high


@njit(cache=True, **OPTIONS)
def _tile(stack, bits, lo, w, pairs, split, special, tile, keys, scratch, bounds, out):  # noqa: ANN001, ANN201
    """Add the products of elements [lo, lo + w) of every pair to its scratch (`bounds[k]`:
    the exponents it holds), or straight to `out[k]` where a row holds Inf or NaN."""
    rows = stack.shape[0]
    stats = keys[3, : 3 * rows]
    for r in range(rows):
        frac, largest, smallest = _widen(stack[r][lo : lo + w], bits[r][lo : lo + w], tile[r])
        stats[3 * r], stats[3 * r + 1] = _significant_bits(frac), largest
        stats[3 * r + 2] = smallest
    for k in range(pairs.shape[0]):
        i, j = pairs[k, 0], pairs[k, 1]
        a, b = tile[i, :w], tile[j, :w]
        if stats[3 * i + 1] == 255 or stats[3 * j + 1] == 255:  # an infinity or NaN
            products = keys[0, :w].view(np.float64)
            for t in range(w):
                products[t] = a[t] * b[t]
            _add_products(products, out[k], split, special)
            continue
        if stats[3 * i + 2] == 255 or stats[3 * j + 2] == 255:  # all products are zero
            continue
        # float64 exponent fields: a float32 field f is f + 896; a subnormal one at least 874
        low_i = np.int64(stats[3 * i + 2]) + 896 if stats[3 * i + 2] > 0 else 874
        low_j = np.int64(stats[3 * j + 2]) + 896 if stats[3 * j + 2] > 0 else 874
        highest = np.int64(stats[3 * i + 1]) + np.int64(stats[3 * j + 1]) + 896 + 896 - 1022
        _claim(scratch[k], bounds[k], max(low_i + low_j - 1023, 1), highest)
        if stats[3 * i] + stats[3 * j] <= _U64(53 - split):  # one addend: the high one
            _keys_one(a, b, split, keys[0, :w], keys[2, :w])
            _scatter_one(keys[0], keys[2], w, scratch[k])
        else:
            _keys(a, b, split, keys[0, :w], keys[1, :w], keys[2, :w])
            _scatter(keys[0], keys[1], keys[2], w, scratch[k])


@njit(cache=True, **OPTIONS)
def _flush(scratch, bounds, split, out):  # noqa: ANN001, ANN201  (numba arrays)
    """Fold each pair's scratch into `out[k]` and empty its bounds."""
    for k in range(bounds.shape[0]):
        if bounds[k, 0] <= bounds[k, 1]:
            _fold(scratch[k], bounds[k, 0], bounds[k, 1], split, out[k])
        bounds[k, 0], bounds[k, 1] = _ROWS, 0


@njit(cache=True, **OPTIONS)
def _work(stack, pairs):  # noqa: ANN001, ANN201  (numba arrays)
    """The float64 tile, the keys (and the rows' bounds), the scratch and the bounds."""
    rows = stack.shape[0]
    tile = np.empty((rows, TILE), np.float64)
    keys = np.empty((4, max(TILE, 3 * rows)), np.uint64)
    scratch = np.empty((pairs.shape[0], 2 * LANES * _BLOCK), np.uint64)
    bounds = np.empty((pairs.shape[0], 2), np.int64)
    bounds[:, 0], bounds[:, 1] = _ROWS, 0
    return tile, keys, scratch, bounds


@njit(cache=True, **OPTIONS)
def gram(stack, pairs, split, special, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[k] += bins of sum_e stack[i, e] * stack[j, e]` for each pair `(i, j) = pairs[k]`
    (float32 rows of `stack`)."""
    n = stack.shape[1]
    bits = stack.view(np.uint32)
    tile, keys, scratch, bounds = _work(stack, pairs)
    for lo in range(0, n, TILE):
        w = min(TILE, n - lo)
        _tile(stack, bits, lo, w, pairs, split, special, tile, keys, scratch, bounds, out)
    _flush(scratch, bounds, split, out)


@njit(cache=True, **OPTIONS)
def row_gram(stack, pairs, row, split, special, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`gram` per row of `row` elements: `out[r, k]` for the r-th whole row of `stack`."""
    bits = stack.view(np.uint32)
    tile, keys, scratch, bounds = _work(stack, pairs)
    for r in range(stack.shape[1] // row):
        for lo in range(r * row, (r + 1) * row, TILE):
            w = min(TILE, (r + 1) * row - lo)
            _tile(stack, bits, lo, w, pairs, split, special, tile, keys, scratch, bounds, out[r])
        _flush(scratch, bounds, split, out[r])


def warm_calls() -> Iterator[Call]:
    """Exact sums of float32 products (the geometric methods' norms and dot products), whole
    and per row, through `kernels.exact_sums` (`kernels.warm`)."""
    from ram_dist.kernels import exact_sums
    from ram_dist.kernels.warm import N

    vectors, pairs = np.zeros((2, N), np.float32), exact_sums.pairs_of(2)
    yield gram, "exact sums", partial(exact_sums.gram, vectors, pairs)
    yield row_gram, "exact sums per row", partial(exact_sums.row_gram, vectors, pairs, N // 2)
