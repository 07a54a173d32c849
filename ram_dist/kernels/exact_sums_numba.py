"""Exact sums of float32 products (numba), bin for bin `methods.exact_sums`' torch rule:
each product is formed exactly (in float64, or in float32 where that is exact), and the
integer significand of its float64 value is split into two addends of `split` bits or fewer,
added to the int64 bins of its exponent (the layout, the bins for infinities and NaN
included, is `methods.exact_sums`'; this kernel takes it as arguments).
No float is ever rounded here.

The work goes a tile of `TILE` elements at a time. One vectorized pass a row bounds its
values (the OR of their fraction bits, their largest and smallest non-zero exponent field,
how many are not zero, in uint32 lanes), and then each pair of rows takes one of three ways:

* float32: where every product is exact in float32 and normal (the significant bits of the
  two rows' widest values add up to at most 24, as bfloat16 x bfloat16's 16 and float16 x
  float16's 22 do, and their exponents keep the product within float32's normal range), the
  products are formed in float32 and each adds its 24-bit significand, in one scalar add, to
  row `bits >> 23` (sign and exponent field) of one of `LANES32` scratch blocks taken in
  turn. Its float64 product's low addend is zero and its high one that significand shifted
  left by 29 - split, which the fold applies to the row's sum.
* float64: the rows are widened once a tile, and each product's float64 bits give, in a
  straight-line vectorized pass, its row of a scratch histogram, 2 * exponent + sign, and its
  addends; then one scalar add per addend into that row, in one of `LANES` blocks taken in
  turn. A product whose significand has at most `53 - split` bits has a zero low addend and
  is added as one addend, its high one.
* Either way, where the sparser row of a pair is mostly zero (a task vector's unchanged
  elements), only its non-zero values' products are formed and added: their indices are
  listed once a tile without a branch a value, and the others are zero. Mostly is seven
  eighths for the float32 way (a listed product costs about one and a half dense ones
  there, its index and both values loaded apart, so at half zero the list saves nothing)
  and a quarter for the float64 way (a dense product there is a widening and two addends;
  `benchmarks/RESULTS.md`).

A negative product counts in a row of its own, subtracted at the end, so no sign is applied
per product; consecutive products go to different blocks so that products of one exponent
do not wait on each other's store. The scratch's float64 rows are zeroed when a sum first
reaches their exponent (bounded from the inputs' exponents), its float32 rows once and again
as they are folded; both are folded into the bins once per sum (`gram`) or per row
(`row_gram`), bin for bin what the eager rule adds. A tile whose rows hold an infinity or
NaN goes product by product instead (`_add_products`, the scalar binning this replaced).
`python -m benchmarks.bench_exact_sums` times the kernel against another checkout's.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, bits, bits64
from ram_dist.kernels.shared_cache import share_compiles

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Elements per tile: the float64 copies of the rows and the products' keys stay in L1/L2.
TILE = 1024
#: Scratch blocks per addend, taken in turn by consecutive products (independent stores).
LANES = 4
_ROWS = 4096  # 2 * exponent + sign of a float64
#: Scratch blocks for the float32 products, taken in turn (their rows: sign and exponent).
LANES32 = 8
_BLOCK32 = 512 + 24
#: Scratch slots per block: a row's slots in two blocks must not lie a multiple of 4 KiB
#: apart (the CPU would take the second load for one of the first store, "4K aliasing").
_BLOCK = _ROWS + 24
_SCRATCH64 = 2 * LANES * _BLOCK  # the float64 products' blocks, then the float32 ones'
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
def _bound(bits):  # noqa: ANN001, ANN201  (numba arrays)
    """What bounds the products of the float32 values `bits` (their uint32 view): the OR of
    their fraction bits, their largest exponent field, the smallest of a non-zero value
    (255 where there is none), and how many are not zero. Every step is cast back to uint32
    (numba widens integers to 64 bits), so that the loop runs 8 or 16 values a vector."""
    frac, largest, least, count = _U32(0), _U32(0), _U32(0xFFFFFFFF), _U32(0)
    for t in range(bits.size):
        magnitude = _U32(bits[t] & _U32(0x7FFFFFFF))
        frac = _U32(frac | magnitude)
        largest = _U32(max(largest, magnitude))
        least = _U32(min(least, _U32(magnitude - _U32(1))))  # a zero wraps to the top
        count = _U32(count + _U32(_U32(magnitude + _U32(0x7FFFFFFF)) >> _U32(31)))
    smallest = _U32(least + _U32(1)) >> _U32(23) if least != _U32(0xFFFFFFFF) else _U32(255)
    return frac & _U32(0x7FFFFF), largest >> _U32(23), smallest, count


@njit(cache=True, **OPTIONS)
def _widen(src, dst):  # noqa: ANN001, ANN201  (numba arrays)
    """dst[:] = float64 of the float32 values src[:]."""
    for t in range(src.size):
        dst[t] = np.float64(src[t])


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
def _scatter_at(a, b, index, m, split, one, scratch):  # noqa: ANN001, ANN201  (numba arrays)
    """`_keys` and `_scatter` (`_keys_one` and `_scatter_one` if `one`) of the products
    a[t] * b[t], formed in float64 from the float32 values, for t in index[:m] only (the
    others are zero: a sparse row's non-zero values)."""
    s = _U64(split)
    low_mask = (_U64(1) << s) - _U64(1)
    high_mask = (_U64(1) << (_U64(52) - s)) - _U64(1)
    hidden = _U64(1) << (_U64(52) - s)
    whole = m - m % LANES
    for u in range(0, whole, LANES):
        for lane in range(LANES):
            t = index[u + lane]
            x = bits64(np.float64(a[t]) * np.float64(b[t]))
            r = ((x >> _U64(51)) & _U64(0xFFE)) | (x >> _U64(63))
            if not one:
                scratch[r + _U64(lane * _BLOCK)] += x & low_mask
            scratch[r + _U64((LANES + lane) * _BLOCK)] += ((x >> s) & high_mask) | hidden
    for u in range(whole, m):
        t = index[u]
        x = bits64(np.float64(a[t]) * np.float64(b[t]))
        r = ((x >> _U64(51)) & _U64(0xFFE)) | (x >> _U64(63))
        scratch[r] += x & low_mask  # zero where `one`
        scratch[r + _U64(LANES * _BLOCK)] += ((x >> s) & high_mask) | hidden


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
def _products32(a, b, products):  # noqa: ANN001, ANN201  (numba arrays)
    """products[t] = the bits of a[t] * b[t] in float32 (the caller has checked that every
    product is exact there: short significands, a normal exponent)."""
    for t in range(a.size):
        products[t] = bits(a[t] * b[t])


@njit(cache=True, **OPTIONS)
def _scatter32(products, n, scratch):  # noqa: ANN001, ANN201  (numba arrays)
    """Add the first n float32 products' significands (24 bits, the hidden one set) to row
    `bits >> 23` (sign and exponent field) of block t % LANES32 of the scratch."""
    whole = n - n % LANES32
    for t in range(0, whole, LANES32):
        for lane in range(LANES32):
            p = products[t + lane]
            at = _U64(p >> _U32(23)) + _U64(lane * _BLOCK32)
            scratch[at] += _U64((p & _U32(0x7FFFFF)) | _U32(0x800000))
    for t in range(whole, n):
        p = products[t]
        scratch[_U64(p >> _U32(23))] += _U64((p & _U32(0x7FFFFF)) | _U32(0x800000))


@njit(cache=True, **OPTIONS)
def _nonzero(bits, index):  # noqa: ANN001, ANN201  (numba arrays)
    """index[:count] = where `bits` (float32 values' uint32 view) are not zero, in order,
    without a branch a value."""
    m = 0
    for t in range(bits.size):
        index[m] = t
        m += 1 if bits[t] & _U32(0x7FFFFFFF) else 0
    return m


@njit(cache=True, **OPTIONS)
def _scatter32_at(a, b, index, m, scratch):  # noqa: ANN001, ANN201  (numba arrays)
    """`_scatter32` of the products a[t] * b[t] for t in index[:m] only (the others are
    zero: a sparse row's non-zero values)."""
    whole = m - m % LANES32
    for u in range(0, whole, LANES32):
        for lane in range(LANES32):
            t = index[u + lane]
            p = bits(a[t] * b[t])
            at = _U64(p >> _U32(23)) + _U64(lane * _BLOCK32)
            scratch[at] += _U64((p & _U32(0x7FFFFF)) | _U32(0x800000))
    for u in range(whole, m):
        t = index[u]
        p = bits(a[t] * b[t])
        scratch[_U64(p >> _U32(23))] += _U64((p & _U32(0x7FFFFF)) | _U32(0x800000))


@njit(cache=True, **OPTIONS)
def _fold32(scratch, lowest, highest, split, bins):  # noqa: ANN001, ANN201  (numba arrays)
    """bins[e + 896 + split] += the significands of float32 exponent field e, shifted to the
    float64 product's high addend (its low one is zero), for e in [lowest, highest]; those
    rows of the scratch are zeroed again."""
    for e in range(lowest, highest + 1):
        total = _U64(0)
        for lane in range(LANES32):
            at = lane * _BLOCK32 + e
            total += scratch[at] - scratch[at + 256]
            scratch[at], scratch[at + 256] = 0, 0
        bins[e + 896 + split] += np.int64(total << _U64(29 - split))


@njit(cache=True, **OPTIONS)
def _rows64(stack, lo, w, i, j, stats, tile):  # noqa: ANN001, ANN201  (numba arrays)
    """Widen rows i and j of the tile to float64 unless done (`stats[5 * r + 3]`)."""
    for r in (i, j):
        if stats[5 * r + 3] & 1 == 0:
            _widen(stack[r][lo : lo + w], tile[r])
            stats[5 * r + 3] |= 1


@njit(cache=True, **OPTIONS)
def _sparser(bits, lo, w, i, j, eighths, stats, keys):  # noqa: ANN001, ANN201, PLR0913
    """(index, m): where the sparser of rows i and j is not zero, index[:m], listed once a
    tile (`stats[5 * r + 3] & 2`) in `keys[4 + r]`, if at most `eighths` eighths of its
    values are not zero; else m = -1 (every product is formed)."""
    sparse = i if stats[5 * i + 4] <= stats[5 * j + 4] else j
    m = np.int64(stats[5 * sparse + 4])
    index = keys[4 + sparse].view(np.uint32)
    if 8 * m > eighths * w:
        return index, np.int64(-1)
    if stats[5 * sparse + 3] & 2 == 0:
        _nonzero(bits[sparse][lo : lo + w], index)
        stats[5 * sparse + 3] |= 2
    return index, m


@njit(cache=True, **OPTIONS)
def _tile(stack, bits, lo, w, pairs, split, special, tile, keys, scratch, bounds, out):  # noqa: ANN001, ANN201
    """Add the products of elements [lo, lo + w) of every pair to its scratch (`bounds[k]`:
    the exponents it holds, float64 then float32), or straight to `out[k]` where a row holds
    Inf or NaN."""
    rows = stack.shape[0]
    stats = keys[3, : 5 * rows]
    for r in range(rows):
        frac, largest, smallest, count = _bound(bits[r][lo : lo + w])
        stats[5 * r], stats[5 * r + 1] = _significant_bits(frac), largest
        stats[5 * r + 2], stats[5 * r + 3], stats[5 * r + 4] = smallest, 0, count
    for k in range(pairs.shape[0]):
        i, j = pairs[k, 0], pairs[k, 1]
        if stats[5 * i + 1] == 255 or stats[5 * j + 1] == 255:  # an infinity or NaN
            _rows64(stack, lo, w, i, j, stats, tile)
            a, b = tile[i, :w], tile[j, :w]
            products = keys[0, :w].view(np.float64)
            for t in range(w):
                products[t] = a[t] * b[t]
            _add_products(products, out[k], split, special)
            continue
        small_i, small_j = np.int64(stats[5 * i + 2]), np.int64(stats[5 * j + 2])
        large_i, large_j = np.int64(stats[5 * i + 1]), np.int64(stats[5 * j + 1])
        if small_i == 255 or small_j == 255:  # all products are zero
            continue
        sig = stats[5 * i] + stats[5 * j]
        a32, b32 = stack[i][lo : lo + w], stack[j][lo : lo + w]
        exact32 = sig <= 24 and split <= 29 and small_i + small_j >= 128
        exact32 = exact32 and large_i + large_j <= 380
        index, m = _sparser(bits, lo, w, i, j, 1 if exact32 else 6, stats, keys)
        if exact32:
            # every product exact in float32, normal: one addend, 16 lanes to form them
            _claim32(bounds[k], small_i + small_j - 127, large_i + large_j - 126)
            products = keys[1].view(np.uint32)
            if m >= 0:  # only the sparser row's non-zero values' products
                _scatter32_at(a32, b32, index, m, scratch[k][_SCRATCH64:])
            else:
                _products32(a32, b32, products)
                _scatter32(products, w, scratch[k][_SCRATCH64:])
            continue
        # float64 exponent fields: a float32 field f is f + 896; a subnormal one at least 874
        low_i = small_i + 896 if small_i > 0 else 874
        low_j = small_j + 896 if small_j > 0 else 874
        highest = large_i + large_j + 896 + 896 - 1022
        _claim(scratch[k], bounds[k], max(low_i + low_j - 1023, 1), highest)
        if m >= 0:
            _scatter_at(a32, b32, index, m, split, sig <= _U64(53 - split), scratch[k])
            continue
        _rows64(stack, lo, w, i, j, stats, tile)
        a, b = tile[i, :w], tile[j, :w]
        if sig <= _U64(53 - split):  # one addend: the high one
            _keys_one(a, b, split, keys[0, :w], keys[2, :w])
            _scatter_one(keys[0], keys[2], w, scratch[k])
        else:
            _keys(a, b, split, keys[0, :w], keys[1, :w], keys[2, :w])
            _scatter(keys[0], keys[1], keys[2], w, scratch[k])


@njit(cache=True, **OPTIONS)
def _claim32(bounds, lowest, highest):  # noqa: ANN001, ANN201  (numba arrays)
    """Widen the float32 rows in use, `bounds[2:4]`, to [lowest, highest] (those rows are
    zero until folded: `_work` zeroes them, `_fold32` zeroes them again)."""
    bounds[2] = min(bounds[2], lowest)
    bounds[3] = max(bounds[3], highest)


@njit(cache=True, **OPTIONS)
def _flush(scratch, bounds, split, out):  # noqa: ANN001, ANN201  (numba arrays)
    """Fold each pair's scratch into `out[k]` and empty its bounds."""
    for k in range(bounds.shape[0]):
        if bounds[k, 0] <= bounds[k, 1]:
            _fold(scratch[k], bounds[k, 0], bounds[k, 1], split, out[k])
        if bounds[k, 2] <= bounds[k, 3]:
            _fold32(scratch[k][_SCRATCH64:], bounds[k, 2], bounds[k, 3], split, out[k])
        bounds[k, 0], bounds[k, 1], bounds[k, 2], bounds[k, 3] = _ROWS, 0, 256, 0


@njit(cache=True, **OPTIONS)
def _work(stack, pairs):  # noqa: ANN001, ANN201  (numba arrays)
    """The float64 tile, the keys (and the rows' bounds), the scratch and the bounds."""
    rows = stack.shape[0]
    tile = np.empty((rows, TILE), np.float64)
    keys = np.empty((4 + rows, max(TILE, 5 * rows)), np.uint64)
    scratch = np.empty((pairs.shape[0], _SCRATCH64 + LANES32 * _BLOCK32), np.uint64)
    scratch[:, _SCRATCH64:] = 0
    bounds = np.empty((pairs.shape[0], 4), np.int64)
    bounds[:, 0], bounds[:, 1], bounds[:, 2], bounds[:, 3] = _ROWS, 0, 256, 0
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


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
