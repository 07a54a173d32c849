"""arcee_fusion's importance and map pass (numba), byte-identical to the eager rule
(`methods.arcee_fusion.importance` and `merge_chunk`).

Per row of the chunk (whole rows of `length`): the base `a` and the model `b` in float32 (the
model's value measured against the base at its precision, `task_values`), each row's KL
`sum p log(p / q)` with `p = softmax(b) + 1e-8`, `q = softmax(a) + 1e-8` in float64, by the
same steps as the eager rule: the row's maximum (NaN if any is), `float64_math`'s exp and log
(the same reductions and polynomials, each step one IEEE operation, no fused multiply-add),
and `rows.tree_sums`' pairwise order (the row padded with +0 to a power of two, then halves
added); rounded to float32 once; the importance `|b - a| * kl` in float32. The map pass then
takes `a + (b - a) * (importance >= threshold)`. The reduce rounds' histograms count the
importances' order keys (`arcee_fusion.order_keys`) as `arcee_fusion.chunk_statistics` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import (
    OPTIONS,
    TILE,
    bits,
    float64_of,
    int_bits64,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, input_size, kernel_inputs, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

# float64_math's constants (its module is the eager rule's; the values are copied here so
# that this module imports nothing of torch's side: `tests/kernels/test_arcee_kernels.py`
# checks they are the same).
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
EXP_TERMS = 14
LOG_TERMS = 13
EXP_MAX = 709.782712893384
EXP_MIN = -745.1332191019412
SQRT2 = 1.4142135623730951
#: 1/n for the exp polynomial (index 0 unused), 1/(2n + 1) for the log series.
INVERSE = np.array([np.inf] + [1.0 / n for n in range(1, EXP_TERMS + 1)])
ODD = np.array([1.0 / (2 * n + 1) for n in range(LOG_TERMS + 1)])
#: mergekit's smoothing of both distributions before the log.
EPS = 1e-8


#: 1.5 * 2**52: a float64 of magnitude below 2**51 plus this is rounded to an integer (to
#: nearest, ties to even, as `np.rint` and `torch.round`), which the sum's low bits hold.
ROUNDER = 6755399441055744.0


@register_jitable(inline="always", **OPTIONS)
def _two_to(k: float) -> float:
    """2.0**k, exact, for integer-valued k in [-1022, 1023] (float64_math's `_two_to`): its
    integer from the bits of `k + ROUNDER`, not a float-to-int conversion (which AVX2 has
    no vector instruction for, so a loop with one is not vectorized)."""
    whole = int_bits64(k + ROUNDER) - int_bits64(ROUNDER)
    return float64_of((whole + np.int64(1023)) << np.int64(52))


# `inline="always"` here and in `log64`: inlined by numba, a loop calling them is vectorized
# by LLVM (without, LLVM leaves the call in the loop: 3x to 4x slower); the steps and their
# rounding are the same, lane by lane.
@register_jitable(inline="always", **OPTIONS)
def exp64(x: float) -> float:
    """`float64_math.exp` of one value, step for step."""
    c = x
    if c < EXP_MIN - 1:
        c = EXP_MIN - 1
    if c > EXP_MAX + 1:
        c = EXP_MAX + 1
    k = (c * INV_LN2 + ROUNDER) - ROUNDER  # torch.round: to nearest, ties to even; exact
    r = (c - k * LN2_HI) - k * LN2_LO
    p = 1.0
    for n in range(EXP_TERMS, 0, -1):
        p = 1.0 + (r * INVERSE[n]) * p
    k = k if k == k else 0.0  # a NaN's result is the NaN below; no NaN cast to an integer
    half = np.floor(k * 0.5)
    out = p * _two_to(half) * _two_to(k - half)
    if x > EXP_MAX:
        out = np.inf
    if x < EXP_MIN:
        out = 0.0
    return x if x != x else out


@register_jitable(inline="always", **OPTIONS)
def log64(x: float) -> float:
    """`float64_math.log` of one value, step for step."""
    tiny = x < 2.0**-1022
    scaled = x * 2.0**54 if tiny else x
    b = int_bits64(scaled)
    e = ((b >> np.int64(52)) & np.int64(0x7FF)) - np.int64(1023) - np.int64(54 if tiny else 0)
    m = float64_of((b & np.int64((1 << 52) - 1)) | np.int64(1023 << 52))
    high = m > SQRT2
    m = m * 0.5 if high else m
    ef = np.float64(e + np.int64(1 if high else 0))
    f = (m - 1.0) / (m + 1.0)
    s = f * f
    series = ODD[LOG_TERMS]
    for n in range(LOG_TERMS - 1, -1, -1):
        series = ODD[n] + s * series
    log_m = 2.0 * f * series
    out = ef * LN2_HI + (ef * LN2_LO + log_m)
    if x == 0:
        out = -np.inf
    if x == np.inf:
        out = x
    if x < 0 or x != x:
        out = np.nan
    return out


@register_jitable(**OPTIONS)
def _tree_sum(x: np.ndarray, length: int, width: int) -> float:
    """`rows.tree_sums` of x[:length] (x has `width` >= length slots, a power of two): the
    row padded with +0, then halves added until one is left. Overwrites x."""
    for j in range(length, width):
        x[j] = 0.0
    half = width // 2
    while half >= 1:
        for j in range(half):
            x[j] = x[j] + x[j + half]
        half //= 2
    return x[0]


@register_jitable(**OPTIONS)
def _softmax(v: np.ndarray, length: int, width: int, e: np.ndarray, out: np.ndarray) -> None:
    """out[:length] = arcee_fusion's `_softmax` of float32 `v` plus EPS, in float64."""
    top = np.float64(v[0])
    for j in range(1, length):
        x = np.float64(v[j])
        if x != x or x > top:  # torch's amax: NaN if any is (then no x is above it)
            top = x
    for j in range(length):
        e[j] = exp64(np.float64(v[j]) - top)
        out[j] = e[j]
    total = _tree_sum(e, length, width)
    for j in range(length):
        out[j] = out[j] / total + EPS


@njit(cache=True, **OPTIONS)
def _importance_kernel(inputs, length, imp):  # noqa: ANN001, ANN201
    """imp[:] = float32 `|b - a| * kl` of the chunk's whole rows of `length` (inputs: the
    base, then the model)."""
    n, buf, vals, rows = tiles_of(inputs, length)  # one row of the tensor
    width = 1
    while width < length:
        width *= 2
    p = np.empty(width, np.float64)
    q = np.empty(width, np.float64)
    scratch = np.empty(width, np.float64)
    for lo in range(0, n, length):
        load_tile_bases(inputs, lo, length, buf)
        a = vals[0]
        b = vals[1]
        if rows[0] != 0:  # the model's value as `task_values` gives it
            at = vals[rows[0]]
            for j in range(length):
                b[j] = a[j] + (b[j] - at[j])
        _softmax(b, length, width, scratch, p)
        _softmax(a, length, width, scratch, q)
        for j in range(length):
            scratch[j] = p[j] * log64(p[j] / q[j])
        kl = np.float32(_tree_sum(scratch, length, width))
        out = imp[lo : lo + length]
        for j in range(length):
            out[j] = abs(b[j] - a[j]) * kl


@njit(cache=True, **OPTIONS)
def _merge_kernel(inputs, imp, limit, out, nan_bits):  # noqa: ANN001, ANN201
    """out[:] = `a + (b - a) * (imp >= limit)` cast to out's dtype."""
    n, buf, vals, rows = tiles_of(inputs, TILE)
    res = np.empty(TILE, np.float32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        _pick_tile(vals, rows[0], imp[lo : lo + m], limit, res[:m])
        store_span(res[:m], out, lo, nan_bits)


@register_jitable
def _pick_tile(vals, row, imp, limit, res):  # noqa: ANN001, ANN202  (numba arrays)
    """res[:] = `a + (b - a) * (imp >= limit)` over a `load_tile_bases` tile, `b - a`
    measured against its row `row` (its own function: compiled apart from the record
    loaders, inlined with them it measured 0.64x main's elements/s)."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    a = vals[0]
    b = vals[1]
    at = vals[row]
    narrowed = row != 0
    for i in range(res.size):
        value = a[i] + (b[i] - at[i]) if narrowed else b[i]
        mask = one if imp[i] >= limit else zero
        res[i] = a[i] + (value - a[i]) * mask


@njit(cache=True, **OPTIONS)
def _histogram_kernel(imp, high, hist):  # noqa: ANN001, ANN201
    """hist += the counts of the order keys of float32 `imp` (-0 as +0, NaN the largest):
    of `key >> 16` (no `high`: round 0), else, per high bin t, of `key & 0xFFFF` where
    `key >> 16 == high[t]` (round 1)."""
    top = np.uint32(0xFFFFFFFF)
    sign = np.uint32(0x80000000)
    for i in range(imp.size):
        v = imp[i] + np.float32(0.0)  # -0 -> +0
        u = bits(v)
        key = (u + sign) if u < sign else (top - u)
        key = top if v != v else key
        if high.size == 0:
            hist[0, key >> np.uint32(16)] += 1
        else:
            for t in range(high.size):
                if np.int64(key >> np.uint32(16)) == high[t]:
                    hist[t, key & np.uint32(0xFFFF)] += 1


def histogram(imp: np.ndarray, high_bins: list[int]) -> np.ndarray:
    """int64 statistic of a chunk's importances: round 0's counts of the keys' high 16 bits
    ([65536]; no `high_bins`), or round 1's of their low 16 bits within each high bin
    ([len(high_bins), 65536])."""
    hist = np.zeros((max(len(high_bins), 1), 1 << 16), np.int64)
    _histogram_kernel(np.asarray(imp, np.float32), np.asarray(high_bins, np.int64), hist)
    return hist if high_bins else hist[0]


def importance(base: ArrayLike, task: ArrayLike, length: int) -> np.ndarray:
    """float32 importances of a chunk of whole rows of `length` (flat)."""
    arrays = kernel_inputs(base, [task])
    n = input_size(arrays[0])
    if length < 1 or n % length:
        raise ValueError(f"{n} elements are not whole rows of {length}")
    imp = np.empty(n, np.float32)
    _importance_kernel(arrays, length, imp)
    return imp


def merge(
    base: ArrayLike,
    task: ArrayLike,
    imp: np.ndarray,
    limit: float,
    out: ArrayLike,
    bf16_nan: int | None = None,
) -> None:
    """Write `a + (b - a) * (imp >= limit)` into `out` (the output's raw array: bfloat16 as
    uint16); `limit` is a float32 value."""
    arrays, target, nan_bits, _ = merge_records(base, [task], out, bf16_nan)
    _merge_kernel(arrays, np.asarray(imp, np.float32), np.float32(limit), target, nan_bits)


KERNELS = (_importance_kernel, _merge_kernel, _histogram_kernel)


def warm_calls() -> Iterator[Call]:
    """arcee_fusion's importances, selection (one task, rows of 4) and histograms of float32
    importances, once each (`kernels.warm`)."""
    from ram_dist.kernels.warm import N, sample

    base, agents, out = sample()
    yield _importance_kernel, "records", partial(importance, base, agents[0], 4)
    pick = partial(merge, base, agents[0], np.zeros(N, np.float32), 0.5, out)
    yield _merge_kernel, "records", pick
    histograms = partial(histogram, np.zeros(N, np.float32), [0])
    yield _histogram_kernel, "arcee_fusion histograms", histograms


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
