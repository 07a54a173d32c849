"""Fused CPU kernels (numba) for DELLA (`della`, `della_linear`): its L1 reduce round and its
map pass, byte-identical to the eager torch path (`della.py` in
`ram_dist.methods.generalized_task_arithmetic`).

Eager DELLA costs about 300 ns per element and pass on one core here: a stable sort of each
row's magnitude keys, a scatter of the ranks, float32 probabilities, the counter-based draws
in int64 tensor ops and the masks, each a pass over the block. These kernels take a chunk
row by row (a chunk holds whole rows): each input row is read once in its stored dtype, the
ranks come from counting (`ascending`: the 31-bit magnitude keys bucketed by their high
bits, equal magnitudes ranked as the eager stable sort ranks them, the lowest index
highest), and probabilities, draws, masks, L1 statistics and the combine step run in
registers or row buffers.

- Probabilities: `f32(density - epsilon) + (f32(r - 1) / (f32(n) - 1) * 2) * f32(epsilon)`,
  op by op in float32 (no fastmath: no FMA), once per rank and task (`by_rank`).
- Draws: splitmix64 of `index * GOLDEN + stream_key` in wrapping uint64 arithmetic, the top
  24 bits; keep when `bits * 2**-24 < p` (`rng.py`).
- Statistics: `dare.l1_statistic`'s bins (per float32 exponent, the sum of significands;
  bin 255 counts 1 per inf and 2**32 per NaN) of delta and of the kept delta.
- Merge: `dare.sparsify` (`delta * 1.0` or `* 0.0`, then `* factor`), then `combine.combine`
  op for op, sums in task order from +0, written in the output's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.drops_numba import draw_bits, l1_bin
from ram_dist.kernels.primitives import (
    ABS32,
    LANES,
    OPTIONS,
    bits,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.ties_numba import combine_scratch, combine_tile
from ram_dist.kernels.views import ArrayLike, input_size, kernel_inputs, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

_TWO_M24 = np.float32(2.0**-24)


#: Counting buckets of a group: at least MIN_BINS, at most MAX_BINS (a power of two about
#: twice its non-zero keys between), so that most buckets hold zero to two keys.
MIN_BINS = 1 << 8
MAX_BINS = 1 << 16
#: A bucket of up to INSERTION keys is ordered by insertion; a larger one by byte radix.
INSERTION = 16


@register_jitable
def rank_scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`ascending`'s scratch for groups of up to n elements: keys, order, swap, and counts
    (the buckets', then a byte radix pass's 257)."""
    bins = MIN_BINS
    while bins < 2 * n and bins < MAX_BINS:
        bins *= 2
    return (np.empty(n, np.uint32), np.empty(n, np.int32), np.empty(n, np.int32),
            np.empty(bins + 1 + 257, np.int32))  # fmt: skip


@register_jitable
def _insertion(keys: np.ndarray, order: np.ndarray, lo: int, hi: int) -> None:
    """Order order[lo:hi] by keys[order[.]] ascending, stably (fast where it nearly is)."""
    top = keys[order[lo]]  # the largest key so far
    for p in range(lo + 1, hi):
        j = order[p]
        k = keys[j]
        if k >= top:
            top = k
            continue
        q = p
        while q > lo and keys[order[q - 1]] > k:
            order[q] = order[q - 1]
            q -= 1
        order[q] = j


@register_jitable
def _radix(
    keys: np.ndarray, order: np.ndarray, lo: int, hi: int, low: np.uint32, high: np.uint32,
    swap: np.ndarray, counts: np.ndarray,
) -> None:  # fmt: skip
    """Order order[lo:hi] (keys in [low, high], low < high) by keys ascending, stably: an
    LSD radix sort of `key - low`, a byte per pass (256 + 1 counts of `counts`)."""
    span = high - low
    shift = np.uint32(0)
    while shift < np.uint32(32) and (span >> shift) > np.uint32(0):
        counts[:257] = 0
        for p in range(lo, hi):
            counts[((keys[order[p]] - low) >> shift & np.uint32(255)) + 1] += 1
        for b in range(256):
            counts[b + 1] += counts[b]
        for p in range(lo, hi):
            j = order[p]
            b = (keys[j] - low) >> shift & np.uint32(255)
            swap[counts[b]] = j
            counts[b] += 1
        for p in range(lo, hi):
            order[p] = swap[p - lo]
        shift += np.uint32(8)


@register_jitable
def ascending(
    keys: np.ndarray, n: int, order: np.ndarray, swap: np.ndarray, counts: np.ndarray
) -> None:
    """order[:n] = the indices of keys[:n] (31-bit magnitude keys) in ascending order, equal
    keys highest index first (so the lowest index ranks highest): element order[p] has rank
    p + 1. By counting, with no branch on a key's value in its passes: the zero keys first,
    in descending index order; the others, listed in descending index order (`swap`),
    scattered by the high bits of their key into buckets (`counts`: a power of two about
    twice as many as they are, over their range), then ordered by their keys within the
    buckets, stably (by byte radix where a bucket holds more than INSERTION keys that
    differ, then by insertion, whose moves stay inside the buckets)."""
    zeros = 0
    low = np.uint32(0xFFFFFFFF)  # the least non-zero key, less one (0 - 1 wraps above all)
    high = np.uint32(0)
    for j in range(n):
        k = keys[j]
        zeros += k == np.uint32(0)
        low = min(low, k - np.uint32(1))
        high = max(high, k)
    low += np.uint32(1)
    placed = 0
    for j in range(n - 1, -1, -1):
        k = keys[j]
        order[n - 1 - j - placed] = j  # kept where k is zero, else written over below
        swap[placed] = j
        placed += k != np.uint32(0)
    if placed == 0:
        return
    bins = np.uint32(counts.size - 258)
    while bins // np.uint32(2) >= np.uint32(2 * placed) and bins > np.uint32(MIN_BINS):
        bins >>= np.uint32(1)
    shift = np.uint32(0)
    while (high >> shift) - (low >> shift) >= bins:
        shift += np.uint32(1)
    first = low >> shift
    used = np.int64((high >> shift) - first) + 1
    counts[: used + 1] = 0
    for i in range(placed):
        counts[np.int64((keys[swap[i]] >> shift) - first) + 1] += 1
    counts[0] = zeros  # bucket b starts at counts[b]
    for b in range(used):
        counts[b + 1] += counts[b]
    for i in range(placed):
        j = swap[i]
        b = np.int64((keys[j] >> shift) - first)
        order[counts[b]] = j
        counts[b] += 1
    if shift == np.uint32(0):
        return  # one key per bucket
    lo = zeros  # counts[b] is now where bucket b ends
    for b in range(used):
        hi = counts[b]
        if hi - lo > INSERTION:  # rare: sorted here, so that insertion below stays short
            k0 = keys[order[lo]]
            lowest, highest = k0, k0
            for p in range(lo + 1, hi):
                lowest = min(lowest, keys[order[p]])
                highest = max(highest, keys[order[p]])
            if lowest < highest:
                _radix(keys, order, lo, hi, lowest, highest, swap, counts[used + 1 :])
        lo = hi
    _insertion(keys, order, zeros, n)  # what is left: inside buckets of few keys


@register_jitable
def by_rank(n: int, lows: np.ndarray, epss: np.ndarray) -> np.ndarray:
    """float32 [N, n]: task t's keep probability of the element of ascending rank p + 1,
    `lows[t] + (f32(p) / (f32(n) - 1) * 2) * epss[t]` op by op (a group of one: 0.5 for
    the quotient)."""
    two = np.float32(2.0)
    span = np.float32(n) - np.float32(1.0)
    table = np.empty((lows.size, n), np.float32)
    for t in range(lows.size):
        for p in range(n):
            norm = np.float32(p) / span if n > 1 else np.float32(0.5)
            table[t, p] = lows[t] + (norm * two) * epss[t]
    return table


@register_jitable
def _probabilities(
    x: np.ndarray, n: int, inner: int, table: np.ndarray,
    scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], probs: np.ndarray,
) -> None:  # fmt: skip
    """probs[i] = keep probability of x[i] (one row of n * inner deltas, groups along n),
    `table[r - 1]` at rank r (a row of `by_rank`); `scratch`: `rank_scratch(n)`."""
    keys, order, swap, counts = scratch
    for c in range(inner):
        for j in range(n):
            keys[j] = bits(x[j * inner + c]) & ABS32
        ascending(keys, n, order, swap, counts)
        for p in range(n):
            probs[order[p] * inner + c] = table[p]


@register_jitable
def _draw(index: int, key: np.uint64) -> np.float32:
    """The uniform float32 of flat element `index` in the stream `key` (`rng.uniform`)."""
    return np.float32(draw_bits(index, key)) * _TWO_M24


@register_jitable
def _keep(start: int, key: np.uint64, probs: np.ndarray, m: int, one: np.float32,
          zero: np.float32) -> None:  # fmt: skip
    """probs[:m] = `one` where the draw of flat element `start + i` is below probs[i], else
    `zero` (a loop of its own: mixed into the loop that uses the mask, the draws run
    several times slower)."""
    for i in range(m):
        probs[i] = one if _draw(start + i, key) < probs[i] else zero


@register_jitable(inline="always")
def _row_work(inputs, n, inner, lows, epss):  # noqa: ANN001, ANN202  (numba arrays)
    """Both kernels' work for a chunk of rows of n * inner elements: (the row's length,
    `tiles_of`'s (size, buf, vals, rows) a row a tile, the ranking (n, inner,
    `rank_scratch(n)`, `by_rank`'s table), a float32 row of probabilities). Inlined where it
    is called (numba's IR), as if written there."""
    row = n * inner
    size, buf, vals, rows = tiles_of(inputs, row)
    ranking = (n, inner, rank_scratch(n), by_rank(n, lows, epss))
    return row, size, buf, vals, rows, ranking, np.empty(row, np.float32)


@register_jitable(inline="always")
def _delta_and_mask(vals, rows, t, row, ranking, sampled, start, key, probs):  # noqa: ANN001, ANN202
    """Task t's delta row, in place of its values (`vals[t + 1]`, returned); where
    `sampled`, its keep mask (1.0 kept, 0.0 dropped) of the draws from flat index `start`
    in the stream `key`, in `probs`. Inlined where it is called (numba's IR)."""
    n, inner, scratch, table = ranking
    x = vals[t + 1]
    base = vals[rows[t]]  # the base at task t's precision
    for i in range(row):
        x[i] = x[i] - base[i]
    if sampled:
        _probabilities(x, n, inner, table[t], scratch, probs)
        _keep(start, key, probs, row, np.float32(1.0), np.float32(0.0))
    return x


@njit(cache=True, **OPTIONS)
def _stats_kernel(
    inputs: tuple[np.ndarray, ...], start: int, n: int, inner: int, sample: np.ndarray,
    keys: np.ndarray, lows: np.ndarray, epss: np.ndarray, stats: np.ndarray,
) -> None:  # fmt: skip
    """stats[t] += (L1 statistic of delta, of kept delta) for each sampled task t."""
    ntasks = len(inputs) - 1
    row, size, buf, vals, rows, ranking, probs = _row_work(inputs, n, inner, lows, epss)
    # increments go to LANES sub-histograms in turn: consecutive ones of a bin (deltas of
    # one exponent, zeros) would wait on each other
    lanes = np.zeros((ntasks, 2, LANES, 256), np.int64)
    for lo in range(0, size, row):
        load_tile_bases(inputs, lo, row, buf)
        for t in range(ntasks):
            if not sample[t]:
                continue
            x = _delta_and_mask(vals, rows, t, row, ranking, True, start + lo, keys[t], probs)
            whole, kept = lanes[t, 0], lanes[t, 1]
            for i in range(row):
                lane = i & (LANES - 1)
                e, sig = l1_bin(x[i])
                whole[lane, e] += sig
                # the kept value as the eager rule forms it: a dropped infinity or NaN is NaN
                e, sig = l1_bin(x[i] * probs[i])
                kept[lane, e] += sig
    for t in range(ntasks):
        for which in range(2):
            for lane in range(LANES):
                for e in range(256):
                    stats[t, which, e] += lanes[t, which, lane, e]


@njit(cache=True, **OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...], start: int, n: int, inner: int, sample: np.ndarray,
    keys: np.ndarray, lows: np.ndarray, epss: np.ndarray, factors: np.ndarray,
    scaled: np.ndarray, weights: np.ndarray, consensus: bool, normalize: bool,
    divisor: np.float32, lam: np.float32, scale: bool, out: np.ndarray, nan_bits: int,
) -> None:  # fmt: skip
    """out[:] = combine(base, DELLA-sparsified deltas) in out's dtype."""
    ntasks = len(inputs) - 1
    row, size, buf, vals, rows, ranking, probs = _row_work(inputs, n, inner, lows, epss)
    total, div, res = combine_scratch(row)
    for lo in range(0, size, row):
        load_tile_bases(inputs, lo, row, buf)
        for t in range(ntasks):
            x = _delta_and_mask(vals, rows, t, row, ranking, sample[t], start + lo, keys[t], probs)
            w = weights[t]
            if sample[t]:
                f = factors[t]
                for i in range(row):
                    d = x[i] * probs[i]
                    if scaled[t]:
                        d = d * f
                    x[i] = d * w
            else:
                for i in range(row):
                    x[i] = x[i] * w
        tile = vals[: ntasks + 1]  # the base and the weighted task vectors
        combine_tile(tile, row, weights, consensus, normalize, divisor, lam, scale, total, div, res)
        store_span(res, out, lo, nan_bits)


# ---- Python API ------------------------------------------------------------------------


def _tasks(
    stream_keys: Sequence[int | None], densities: Sequence[float], epsilons: Sequence[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per task: sampled or not (a None key), stream key, f32(density - eps), f32(eps)."""
    sample = np.array([k is not None for k in stream_keys], np.bool_)
    keys = np.array([k or 0 for k in stream_keys], np.uint64)
    lows = np.array([d - e for d, e in zip(densities, epsilons, strict=True)], np.float32)
    return sample, keys, lows, np.asarray(epsilons, np.float32)


def statistics(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    *,
    start: int,
    groups: tuple[int, int],
    stream_keys: Sequence[int | None],
    densities: Sequence[float],
    epsilons: Sequence[float],
) -> np.ndarray:
    """int64 [N, 2, 256]: per task the L1 statistics of delta and of the kept delta (zero
    rows where `stream_keys[t]` is None: a task that is not sampled). `groups` is
    `della.rank_groups` of the tensor; the chunk holds whole rows."""
    arrays = kernel_inputs(base, tasks)
    size = input_size(arrays[0])
    n, inner = groups
    if size % (n * inner):
        raise ValueError(f"a chunk of {size} elements is not whole rows of {n * inner}")
    stats = np.zeros((len(arrays) - 1, 2, 256), np.int64)
    if size == 0:
        return stats
    _stats_kernel(arrays, start, n, inner, *_tasks(stream_keys, densities, epsilons), stats)
    return stats


def merge(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    start: int,
    groups: tuple[int, int],
    stream_keys: Sequence[int | None],
    densities: Sequence[float],
    epsilons: Sequence[float],
    factors: Sequence[float | None],
    weights: Sequence[float],
    consensus: bool,
    normalize: bool,
    divisor: float,
    lambda_: float,
    bf16_nan: int | None = None,
) -> None:
    """Write the eager `Della.merge_chunk` into `out` (float32 factors and weights; `divisor`
    the plain weight sum, 1 where mergekit takes it as zero; `lambda_` applied unless 1)."""
    arrays, target, nan_bits, size = merge_records(base, tasks, out, bf16_nan)
    n, inner = groups
    if size % (n * inner):
        raise ValueError(f"a chunk of {size} elements is not whole rows of {n * inner}")
    if size == 0:
        return
    _merge_kernel(
        arrays, start, n, inner, *_tasks(stream_keys, densities, epsilons),
        np.array([f or 0.0 for f in factors], np.float32),
        np.array([f is not None for f in factors], np.bool_),
        np.asarray(weights, np.float32), consensus, normalize, np.float32(divisor),
        np.float32(lambda_), lambda_ != 1, target, nan_bits,
    )  # fmt: skip


KERNELS = (_stats_kernel, _merge_kernel)


def warm_calls() -> Iterator[Call]:
    """DELLA's statistics and merge, once each (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    n, size = len(agents), int(base.numel())
    args = dict(
        start=0, groups=(size, 1), stream_keys=[1] * n, densities=[0.5] * n, epsilons=[0.1] * n
    )  # fmt: skip
    yield _stats_kernel, "records", partial(statistics, base, agents, **args)
    merged = partial(
        merge, base, agents, out, **args, factors=[None] * n, weights=[1.0] * n,
        consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
    )  # fmt: skip
    yield _merge_kernel, "records", merged


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
