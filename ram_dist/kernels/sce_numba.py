"""sce's map pass (numba), byte-identical to `methods.sce.SCE.merge_chunk` cast to the output
dtype: each task vector measured against the base at its precision, optionally kept by the
variance selection, then the sign election and the disjoint merge, op by op in float32.

- Selection (`select_topk` < 1): the per-element variance across the task vectors by the
  same float64 Welford steps as `sce.variance` (`delta = x - mean`, `mean += delta / count`,
  `m2 += delta * (x - mean)`, `m2 / N` rounded to float32), its key the bits of its absolute
  value, kept as `topk.keep_mask` keeps (`key > threshold`, or equal to it and before the
  flat index cut); a task vector not kept is `d * 0.0`, as the eager `d * keep`.
- Election: `s = +1` where `((0 + d_1) + d_2) + ... >= 0` (NaN: -1); task t counts where
  its sign is s, with the weight `e_t = w_t * 1.0` (else `w_t * 0.0`).
- Merge: `base + ((0 + d_1 e_1) + ...) / max((0 + e_1) + ..., 1e-6)` (torch's `clamp`,
  a NaN stays NaN).

The selection's reduce rounds (`statistics`, `_stats_kernel`) take the same variance keys
from the same tiles: round 0's histogram of `key >> 16` and count of non-zero keys, round
1's of `key & 0xFFFF` in the high bin, rounds 2-3's of the flat indices of keys equal to
the cut (`topk`'s histograms), and the sums of squares of the kept task vectors (`d * keep`,
exact sums binned by `exact_sums_numba`'s tile step). The inputs are records, so a quantized
one is decoded as its tile loads, with no float32 copy of any input.

No fastmath, so no multiply-add is contracted into an FMA (`fma_check.fma_findings`).
TIES's kernel (`ties_numba`) weights the task vectors before its election and floors its
divisor at 1, so it is not this rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.exact_sums import _POS_INF, _SPLIT, BINS
from ram_dist.kernels.exact_sums_numba import TILE as SUMS_TILE
from ram_dist.kernels.exact_sums_numba import _flush, _tile, _work
from ram_dist.kernels.primitives import (
    ABS32,
    OPTIONS,
    TILE,
    bits,
    load_tile_bases,
    store_span,
    task_vectors,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.ties_numba import election_start
from ram_dist.kernels.views import ArrayLike, kernel_inputs, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: The selection: none (every position kept), none kept (k = 0), or the variance cut.
SELECT_NONE, SELECT_EMPTY, SELECT_CUT = 0, 1, 2
#: mergekit's floor of the divisor (a float32 value, as torch's `clamp` takes it).
MIN_DIVISOR = np.float32(1e-6)
#: The selection's statistics: `topk`'s four histograms of the variance keys, and the sums
#: of squares of the kept task vectors.
HIGH, LOW, INDEX_HIGH, INDEX_LOW, SQUARES = 0, 1, 2, 3, 4


@njit(cache=True, **OPTIONS)
def _merge_kernel(inputs, select, threshold, index_cut, start, weights, out, nan_bits):  # noqa: ANN001, ANN201, PLR0913  (numba arrays)
    """out[:] = sce's merge of `inputs` (base first) cast to out's dtype (see the module);
    `threshold` and `index_cut` (-1: none) are the variance cut's, `start` the flat index of
    the first element."""
    n, buf, vals, rows = tiles_of(inputs, TILE)
    scratch = (np.empty(TILE, np.float64), np.empty(TILE, np.float64),
               np.empty(TILE, np.float32), np.empty(TILE, np.float32))  # fmt: skip
    res = np.empty(TILE, np.float32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        _sce_tile(vals, rows, m, select, threshold, index_cut, start + lo, weights, scratch, res)
        store_span(res[:m], out, lo, nan_bits)


@register_jitable
def _sce_tile(vals, rows, m, select, threshold, index_cut, first, weights, scratch, res):  # noqa: ANN001, ANN202, PLR0913
    """res[:m] = sce's merge of a `load_tile_bases` tile whose first element is flat index
    `first` (its own function: compiled apart from the record loaders, inlined with them it
    measured 9 % slower)."""
    mean, m2, total, div = scratch
    ntasks = rows.size
    zero = np.float32(0.0)
    one = np.float32(1.0)
    count = np.float64(ntasks)
    for t in range(ntasks):  # the task vectors, over the tasks' rows
        x = vals[t + 1]
        base = vals[rows[t]]  # the base at task t's precision
        for i in range(m):
            x[i] = x[i] - base[i]
    if select == 1:
        for t in range(ntasks):
            x = vals[t + 1]
            for i in range(m):
                x[i] = x[i] * zero
    elif select == 2:
        _welford(vals, ntasks, m, mean, m2)
        for i in range(m):
            key = np.int64(bits(np.float32(m2[i] / count)) & ABS32)
            kept = key > threshold or (
                key == threshold and (index_cut < 0 or first + i < index_cut)
            )
            res[i] = one if kept else zero
        for t in range(ntasks):
            x = vals[t + 1]
            for i in range(m):
                x[i] = x[i] * res[i]
    election_start(vals, ntasks, m, res, total, div)
    for t in range(ntasks):
        x = vals[t + 1]
        w = weights[t]
        for i in range(m):
            d = x[i]
            agree = (d > zero) if res[i] >= zero else (d < zero)
            e = w * (one if agree else zero)
            total[i] = total[i] + d * e
            div[i] = div[i] + e
    b = vals[0]
    for i in range(m):
        divisor = MIN_DIVISOR if div[i] < MIN_DIVISOR else div[i]
        res[i] = b[i] + total[i] / divisor


@register_jitable
def _variance_keys(vals, m, mean, m2, keys):  # noqa: ANN001, ANN202  (numba arrays)
    """keys[:m] = the bits of |variance| across the task vectors in rows 1.. of `vals`:
    `_sce_tile`'s float64 Welford steps, op for op (`sce.variance`, `topk.magnitude_keys`).
    The merge keeps its copy inline: its cut's keys taken from here (an int64 row a tile)
    ran slower on one thread (best of 8 runs: 93 against 122 M el/s, on a loaded machine)."""
    ntasks = vals.shape[0] - 1
    count = np.float64(ntasks)
    _welford(vals, ntasks, m, mean, m2)
    for i in range(m):
        keys[i] = np.int64(bits(np.float32(m2[i] / count)) & ABS32)


@register_jitable(inline="always")
def _welford(vals, ntasks, m, mean, m2):  # noqa: ANN001, ANN202  (numba arrays)
    """mean[:m], m2[:m] = the float64 Welford sums over the task vectors in rows 1 to
    `ntasks` of `vals` (`sce.variance`: `delta = x - mean`, `mean += delta / count`,
    `m2 += delta * (x - mean)`), whose variance is `m2 / ntasks`. Inlined where it is called
    (numba's IR), so each caller compiles it as if written there."""
    for i in range(m):
        mean[i] = 0.0
        m2[i] = 0.0
    for t in range(ntasks):
        x = vals[t + 1]
        steps = np.float64(t + 1)
        for i in range(m):
            v = np.float64(x[i])
            delta = v - mean[i]
            mean[i] = mean[i] + delta / steps
            m2[i] = m2[i] + delta * (v - mean[i])


@njit(cache=True, **OPTIONS)
def _stats_kernel(inputs, kind, threshold, index_cut, select_bin, start, hist, squares):  # noqa: ANN001, ANN201, PLR0913  (numba arrays)
    """hist[:] += statistic `kind` of the variance keys of `inputs` (base first; HIGH also
    counts the non-zero keys in hist[-1]), or, SQUARES, squares[t] += the exact sums of
    squares of task t's vector kept by the cut (`threshold`, `index_cut`, -1: none);
    `select_bin` is LOW's high bin or INDEX_LOW's index bin, `start` the flat index of the
    first element."""
    ntasks = inputs.shape[0] - 1
    n, buf, vals, rows = tiles_of(inputs, SUMS_TILE)
    mean, m2 = np.empty(SUMS_TILE, np.float64), np.empty(SUMS_TILE, np.float64)
    keys = np.empty(SUMS_TILE, np.int64)
    stack = np.empty((ntasks, SUMS_TILE), np.float32)
    stack_bits = stack.view(np.uint32)
    pairs = np.empty((ntasks, 2), np.int64)
    for t in range(ntasks):
        pairs[t, 0], pairs[t, 1] = t, t
    tile, scratch_keys, scratch, bounds = _work(stack, pairs)
    one, zero = np.float32(1.0), np.float32(0.0)
    bins = hist.size - 1 if kind == 0 else hist.size
    for lo in range(0, n, SUMS_TILE):
        m = min(SUMS_TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        task_vectors(vals, rows, m)
        _variance_keys(vals[: ntasks + 1], m, mean, m2, keys)
        if kind == 0:
            found = 0
            for i in range(m):
                hist[keys[i] >> 16] += 1
                found += 1 if keys[i] != 0 else 0
            hist[bins] += found
        elif kind == 1:
            for i in range(m):
                if (keys[i] >> 16) == select_bin:
                    hist[keys[i] & 0xFFFF] += 1
        elif kind == 2 or kind == 3:
            for i in range(m):
                index = start + lo + i
                if keys[i] != threshold:
                    continue
                if kind == 2:
                    hist[index >> 16] += 1
                elif (index >> 16) == select_bin:
                    hist[index & 0xFFFF] += 1
        else:
            for i in range(m):
                key = keys[i]
                kept = key > threshold or (
                    key == threshold and (index_cut < 0 or start + lo + i < index_cut)
                )
                mean[i] = one if kept else zero  # the keep mask, as float32 values
            for t in range(ntasks):
                x, dst = vals[t + 1], stack[t]
                for i in range(m):
                    dst[i] = x[i] * np.float32(mean[i])
            _tile(stack, stack_bits, 0, m, pairs, _SPLIT, _POS_INF, tile, scratch_keys, scratch,
                  bounds, squares)  # fmt: skip
    if kind == 4:
        _flush(scratch, bounds, _SPLIT, squares)


def statistics(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    kind: int,
    *,
    size: int = 0,
    threshold: int = -1,
    index_cut: int | None = None,
    select_bin: int = -1,
    start: int = 0,
) -> tuple[np.ndarray, int]:
    """The selection's statistic `kind` of a chunk (`start` its first flat index): int64
    [size], `topk`'s histogram of the variance keys (and, HIGH, the count of non-zero
    keys), or, SQUARES, int64 [N, BINS] the exact sums of squares of the kept task vectors
    (`threshold`, `index_cut`: the cut, as `merge` takes it) and 0."""
    arrays = kernel_inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros(size + (1 if kind == HIGH else 0), np.int64)
    squares = np.zeros((ntasks if kind == SQUARES else 0, BINS), np.int64)
    cut = np.int64(-1 if index_cut is None else index_cut)
    _stats_kernel(arrays, np.int64(kind), np.int64(threshold), cut, np.int64(select_bin),
                  np.int64(start), hist, squares)  # fmt: skip
    if kind == SQUARES:
        return squares, 0
    if kind == HIGH:
        return hist[:-1], int(hist[-1])
    return hist, 0


def merge(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    weights: Sequence[float],
    select: int = SELECT_NONE,
    threshold: int = -1,
    index_cut: int | None = None,
    start: int = 0,
    bf16_nan: int | None = None,
) -> None:
    """Write sce's merge into `out` (the output's raw array: bfloat16 as uint16): `weights`
    are float32 values; `select` is SELECT_*, with the cut's `threshold` key and `index_cut`
    (None: every key equal to the threshold is kept) for SELECT_CUT."""
    arrays, target, nan_bits, _ = merge_records(base, tasks, out, bf16_nan)
    if len(weights) != len(arrays) - 1:
        raise ValueError(f"{len(weights)} weights for {len(arrays) - 1} tasks")
    _merge_kernel(
        arrays,
        select,
        np.int64(threshold),
        np.int64(-1 if index_cut is None else index_cut),
        np.int64(start),
        np.asarray(weights, np.float32),
        target,
        nan_bits,
    )


KERNELS = (_merge_kernel, _stats_kernel)


def warm_calls() -> Iterator[Call]:
    """sce's merge and its selection's statistics (the kind is a value: one signature), once
    each (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    yield _merge_kernel, "records", partial(merge, base, agents, out, weights=[1.0] * len(agents))
    yield _stats_kernel, "records", partial(statistics, base, agents, SQUARES)


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
