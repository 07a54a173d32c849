"""Fused CPU kernels (numba) for DARE (`dare_linear`, `dare_ties`): its L1 reduce round and
its map pass, byte-identical to the eager torch path (`dare.py` in
`ram_dist.methods.generalized_task_arithmetic`).

Eager DARE forms, per task, float32 task vectors, the counter-based draws in int64 tensor
ops (a dozen passes over an int64 block), a boolean mask and its float32 copy, the masked
and rescaled vectors, then the combine step's sums, each a pass over the block. These
kernels read each input element once in its stored dtype (the tile loaders of
`primitives`) and keep the rest in a tile.

- Draws (`rng.random_bits`): splitmix64 of `index * GOLDEN + stream_key` in wrapping uint64
  arithmetic, its top 24 bits; element `index` is kept when they are below the task's
  threshold (`dare.keep_threshold`). Computed in a loop of their own into a float32 mask
  (1.0 or 0.0): mixed into the loop that uses the mask, the draws run several times slower.
- Statistics (`dare.chunk_statistics`): `dare.l1_statistic`'s bins (per float32 exponent,
  the sum of significands; bin 255 counts 1 per inf and 2**32 per NaN) of delta and of
  `delta * mask` (a dropped infinity is NaN there, as in the eager product).
- Merge (`dare.merge_chunk`): `dare.sparsify` (`delta * 1.0` or `* 0.0`, then `* factor`
  where a rescale factor is given; a task of density >= 1 untouched), `* w_t`, then
  `combine.combine` op for op (`ties_numba.combine_tile`), sums in task order from +0,
  written in the output's dtype; no fastmath, so no multiply-add is contracted into an FMA.
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
    LANES,
    OPTIONS,
    TILE,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.ties_numba import combine_scratch, combine_tile
from ram_dist.kernels.views import ArrayLike, input_size, kernel_inputs, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


@register_jitable
def _mask(start: int, key: np.uint64, threshold: np.uint64, mask: np.ndarray, m: int) -> None:
    """mask[:m] = 1.0 where the 24-bit draw of flat element `start + i` in stream `key` is
    below `threshold`, else 0.0 (`dare.dare_keep_mask` as float32)."""
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for i in range(m):
        mask[i] = one if draw_bits(start + i, key) < threshold else zero


@njit(cache=True, **OPTIONS)
def _stats_kernel(
    inputs: tuple[np.ndarray, ...], start: int, sample: np.ndarray, keys: np.ndarray,
    thresholds: np.ndarray, stats: np.ndarray,
) -> None:  # fmt: skip
    """stats[t] += (L1 statistic of delta, of masked delta) for each sampled task t."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    mask = np.empty(TILE, np.float32)
    # increments go to LANES sub-histograms in turn: consecutive ones of a bin (deltas of
    # one exponent, zeros) would wait on each other
    lanes = np.zeros((ntasks, 2, LANES, 256), np.int64)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        for t in range(ntasks):
            if not sample[t]:
                continue
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            _mask(start + lo, keys[t], thresholds[t], mask, m)
            whole, kept = lanes[t, 0], lanes[t, 1]
            for i in range(m):
                d = x[i] - base[i]
                lane = i & (LANES - 1)
                e, sig = l1_bin(d)
                whole[lane, e] += sig
                e, sig = l1_bin(d * mask[i])
                kept[lane, e] += sig
    for t in range(ntasks):
        for which in range(2):
            for lane in range(LANES):
                for e in range(256):
                    stats[t, which, e] += lanes[t, which, lane, e]


@njit(cache=True, **OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...], start: int, sample: np.ndarray, keys: np.ndarray,
    thresholds: np.ndarray, factors: np.ndarray, scaled: np.ndarray, weights: np.ndarray,
    consensus: bool, normalize: bool, divisor: np.float32, lam: np.float32, scale: bool,
    out: np.ndarray, nan_bits: int,
) -> None:  # fmt: skip
    """out[:] = combine(base, DARE-sparsified deltas) in out's dtype."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    mask = np.empty(TILE, np.float32)
    total, div, res = combine_scratch(TILE)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        # weighted_t = sparsify(delta_t) * w_t, written over the task's row
        for t in range(ntasks):
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            w = weights[t]
            if not sample[t]:  # density >= 1: the delta untouched
                for i in range(m):
                    x[i] = (x[i] - base[i]) * w
                continue
            _mask(start + lo, keys[t], thresholds[t], mask, m)
            if scaled[t]:
                f = factors[t]
                for i in range(m):
                    x[i] = (((x[i] - base[i]) * mask[i]) * f) * w
            else:
                for i in range(m):
                    x[i] = ((x[i] - base[i]) * mask[i]) * w
        tile = vals[: ntasks + 1]  # the base and the weighted task vectors
        combine_tile(tile, m, weights, consensus, normalize, divisor, lam, scale, total, div, res)
        store_span(res[:m], out, lo, nan_bits)


# ---- Python API ------------------------------------------------------------------------


def _tasks(
    stream_keys: Sequence[int | None], thresholds: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per task: sampled or not (a None key: density >= 1), stream key, keep threshold."""
    if len(stream_keys) != len(thresholds):
        raise ValueError("stream_keys and thresholds must have one entry per task")
    sample = np.array([k is not None for k in stream_keys], np.bool_)
    keys = np.array([k or 0 for k in stream_keys], np.uint64)
    return sample, keys, np.asarray(thresholds, np.uint64)


def statistics(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    *,
    start: int,
    stream_keys: Sequence[int | None],
    thresholds: Sequence[int],
) -> np.ndarray:
    """int64 [N, 2, 256]: per task the L1 statistics of delta and of the kept delta (zero
    rows where `stream_keys[t]` is None: a task of density >= 1). `start` is the chunk's
    first flat index in its tensor; `stream_keys[t]` is `rng.stream_key(seed, t, name)`,
    `thresholds[t]` is `dare.keep_threshold(density_t)`."""
    arrays = kernel_inputs(base, tasks)
    stats = np.zeros((len(arrays) - 1, 2, 256), np.int64)
    if input_size(arrays[0]) == 0:
        return stats
    _stats_kernel(arrays, start, *_tasks(stream_keys, thresholds), stats)
    return stats


def merge(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    start: int,
    stream_keys: Sequence[int | None],
    thresholds: Sequence[int],
    factors: Sequence[float | None],
    weights: Sequence[float],
    consensus: bool,
    normalize: bool,
    divisor: float,
    lambda_: float,
    bf16_nan: int | None = None,
) -> None:
    """Write the eager `dare.merge_chunk` into `out` (`stream_keys` and `thresholds` as for
    `statistics`; float32 factors (None: no rescale) and weights; `divisor` the plain weight
    sum, 1 where mergekit takes it as zero; `lambda_` applied unless 1)."""
    arrays, target, nan_bits, size = merge_records(base, tasks, out, bf16_nan)
    ntasks = len(arrays) - 1
    if not len(weights) == len(factors) == ntasks:
        raise ValueError(f"weights and factors must have one entry per task ({ntasks})")
    if size == 0:
        return
    _merge_kernel(
        arrays, start, *_tasks(stream_keys, thresholds),
        np.array([f or 0.0 for f in factors], np.float32),
        np.array([f is not None for f in factors], np.bool_),
        np.asarray(weights, np.float32), consensus, normalize, np.float32(divisor),
        np.float32(lambda_), lambda_ != 1, target, nan_bits,
    )  # fmt: skip


KERNELS = (_stats_kernel, _merge_kernel)


def warm_calls() -> Iterator[Call]:
    """DARE's statistics and merge, once each (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    n = len(agents)
    args = dict(start=0, stream_keys=[1] * n, thresholds=[1 << 23] * n)
    yield _stats_kernel, "records", partial(statistics, base, agents, **args)
    merged = partial(
        merge, base, agents, out, **args, factors=[None] * n, weights=[1.0] * n,
        consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
    )  # fmt: skip
    yield _merge_kernel, "records", merged


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
