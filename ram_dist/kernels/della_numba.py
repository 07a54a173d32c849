"""Fused CPU kernels (numba) for DELLA (`della`, `della_linear`): its L1 reduce round and its
map pass, byte-identical to the eager torch path (`della.py` in
`ram_dist.methods.generalized_task_arithmetic`).

Eager DELLA costs about 300 ns per element and pass on one core here: a stable sort of each
row's magnitude keys, a scatter of the ranks, float32 probabilities, the counter-based draws
in int64 tensor ops and the masks, each a pass over the block. These kernels take a chunk
row by row (a chunk holds whole rows): each input row is read once in its stored dtype, the
ranks come from a stable LSD radix sort of the 31-bit magnitude keys, a byte per pass,
started from the highest index (ascending magnitude, equal magnitudes: the lowest index
ranks highest, as the eager stable sort), and
probabilities, draws, masks, L1 statistics and the combine step run in registers.

- Probabilities: `f32(density - epsilon) + (f32(r - 1) / (f32(n) - 1) * 2) * f32(epsilon)`,
  op by op in float32 (no fastmath: no FMA).
- Draws: splitmix64 of `index * GOLDEN + stream_key` in wrapping uint64 arithmetic, the top
  24 bits; keep when `bits * 2**-24 < p` (`rng.py`).
- Statistics: `dare.l1_statistic`'s bins (per float32 exponent, the sum of significands;
  bin 255 counts 1 per inf and 2**32 per NaN) of delta and of the kept delta.
- Merge: `dare.sparsify` (`delta * 1.0` or `* 0.0`, then `* factor`), then `combine.combine`
  op for op, sums in task order from +0, written in the output's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import (
    ABS32,
    OPTIONS,
    base_rows,
    bits,
    load_tile_bases,
    size_of,
    store,
)
from ram_dist.kernels.ties_numba import combine_tile
from ram_dist.kernels.views import (
    ArrayLike,
    input_size,
    kernel_inputs,
    kernel_output,
    torch_bf16_nan,
)

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)
_TWO_M24 = np.float32(2.0**-24)
_NAN_UNIT = np.int64(1 << 32)


@register_jitable
def _probabilities(
    x: np.ndarray, n: int, inner: int, low: np.float32, eps: np.float32, work: np.ndarray,
    probs: np.ndarray,
) -> None:  # fmt: skip
    """probs[i] = keep probability of x[i] (one row of n * inner deltas, groups along n).
    `work`: int64[3, n] scratch (keys, order, swap) and the 257 counts after them."""
    two = np.float32(2.0)
    span = np.float32(n) - np.float32(1.0)
    half = np.float32(0.5)
    keys = work[0]
    order = work[1]
    swap = work[2]
    counts = work[3, :257]
    for c in range(inner):
        for j in range(n):
            keys[j] = np.int64(bits(x[j * inner + c]) & ABS32)
            order[j] = n - 1 - j  # a stable sort keeps equal keys highest index first
        # LSD radix sort of the 31-bit keys, a byte per pass (a pass where every key has
        # the same byte changes nothing and is skipped)
        for shift in range(0, 32, 8):
            counts[:] = 0
            for j in range(n):
                counts[((keys[order[j]] >> shift) & 255) + 1] += 1
            if counts[((keys[order[0]] >> shift) & 255) + 1] == n:
                continue
            for b in range(256):
                counts[b + 1] += counts[b]
            for j in range(n):
                k = order[j]
                b = (keys[k] >> shift) & 255
                swap[counts[b]] = k
                counts[b] += 1
            for j in range(n):
                order[j] = swap[j]
        for p in range(n):
            norm = np.float32(p) / span if n > 1 else half
            probs[order[p] * inner + c] = low + (norm * two) * eps


@register_jitable
def _draw(index: int, key: np.uint64) -> np.float32:
    """The uniform float32 of flat element `index` in the stream `key` (`rng.uniform`)."""
    z = _U64(index) * _GOLDEN + key
    z = (z ^ (z >> _U64(30))) * _MUL1
    z = (z ^ (z >> _U64(27))) * _MUL2
    z = z ^ (z >> _U64(31))
    return np.float32(z >> _U64(40)) * _TWO_M24


@register_jitable
def _l1_bin(d: np.float32) -> tuple[int, np.int64]:
    """`dare.l1_statistic` of one value: its bin and what it adds there."""
    b = bits(d) & ABS32
    e = np.int64(b >> 23)
    frac = np.int64(b & 0x7FFFFF)
    if e == 255:
        return 255, np.int64(1) if frac == 0 else _NAN_UNIT
    return e, (frac | 0x800000) if e > 0 else frac


@njit(cache=True, **OPTIONS)
def _stats_kernel(
    inputs: tuple[np.ndarray, ...], start: int, n: int, inner: int, sample: np.ndarray,
    keys: np.ndarray, lows: np.ndarray, epss: np.ndarray, stats: np.ndarray,
) -> None:  # fmt: skip
    """stats[t] += (L1 statistic of delta, of kept delta) for each sampled task t."""
    size = size_of(inputs[0])
    ntasks = len(inputs) - 1
    row = n * inner
    buf = np.empty((2 * ntasks + 1, row), np.uint32)  # `load_tile_bases`' rows
    vals = buf.view(np.float32)
    rows = base_rows(inputs)
    work = np.empty((4, max(n, 257)), np.int64)
    probs = np.empty(row, np.float32)
    for lo in range(0, size, row):
        load_tile_bases(inputs, lo, row, buf)
        for t in range(ntasks):
            if not sample[t]:
                continue
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            for i in range(row):
                x[i] = x[i] - base[i]
            _probabilities(x, n, inner, lows[t], epss[t], work, probs)
            for i in range(row):
                e, sig = _l1_bin(x[i])
                stats[t, 0, e] += sig
                if _draw(start + lo + i, keys[t]) < probs[i]:
                    stats[t, 1, e] += sig


@njit(cache=True, **OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...], start: int, n: int, inner: int, sample: np.ndarray,
    keys: np.ndarray, lows: np.ndarray, epss: np.ndarray, factors: np.ndarray,
    scaled: np.ndarray, weights: np.ndarray, consensus: bool, normalize: bool,
    divisor: np.float32, lam: np.float32, scale: bool, out: np.ndarray, nan_bits: int,
) -> None:  # fmt: skip
    """out[:] = combine(base, DELLA-sparsified deltas) in out's dtype."""
    size = size_of(inputs[0])
    ntasks = len(inputs) - 1
    row = n * inner
    buf = np.empty((2 * ntasks + 1, row), np.uint32)  # `load_tile_bases`' rows
    vals = buf.view(np.float32)
    rows = base_rows(inputs)
    work = np.empty((4, max(n, 257)), np.int64)
    probs = np.empty(row, np.float32)
    total = np.empty(row, np.float32)
    div = np.empty(row, np.float32)
    res = np.empty(row, np.float32)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for lo in range(0, size, row):
        load_tile_bases(inputs, lo, row, buf)
        for t in range(ntasks):
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            w = weights[t]
            for i in range(row):
                x[i] = x[i] - base[i]
            if sample[t]:
                _probabilities(x, n, inner, lows[t], epss[t], work, probs)
                f = factors[t]
                for i in range(row):
                    d = x[i] * (one if _draw(start + lo + i, keys[t]) < probs[i] else zero)
                    if scaled[t]:
                        d = d * f
                    x[i] = d * w
            else:
                for i in range(row):
                    x[i] = x[i] * w
        tile = vals[: ntasks + 1]  # the base and the weighted task vectors
        combine_tile(tile, row, weights, consensus, normalize, divisor, lam, scale, total, div, res)
        store(res, out[lo : lo + row], nan_bits)


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
    arrays = kernel_inputs(base, tasks)
    size = input_size(arrays[0])
    target = kernel_output(out, size)
    n, inner = groups
    if size % (n * inner):
        raise ValueError(f"a chunk of {size} elements is not whole rows of {n * inner}")
    if size == 0:
        return
    nan_bits = torch_bf16_nan() if bf16_nan is None else bf16_nan
    _merge_kernel(
        arrays, start, n, inner, *_tasks(stream_keys, densities, epsilons),
        np.array([f or 0.0 for f in factors], np.float32),
        np.array([f is not None for f in factors], np.bool_),
        np.asarray(weights, np.float32), consensus, normalize, np.float32(divisor),
        np.float32(lambda_), lambda_ != 1, target, nan_bits,
    )  # fmt: skip


KERNELS = (_stats_kernel, _merge_kernel)
