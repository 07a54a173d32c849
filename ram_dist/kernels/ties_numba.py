"""Fused CPU kernels (numba) for TIES's reduce rounds and for the task-arithmetic family's
map pass (task_arithmetic, ties; breadcrumbs' rounds and map pass), byte-identical to the
eager torch path.

Eager TIES costs about 150 ns per element and round on 2 cores here: every round rebuilds
float32 task vectors, int64 keys and boolean masks of the whole block before a `bincount`.
These kernels read each input element once per round in its stored dtype (the tile
loaders of `primitives`), keep everything else in registers or an L2-sized tile, and write
the output dtype directly.

Names in backquotes are modules of `ram_dist.methods.generalized_task_arithmetic`.

- Statistics (`topk.py`'s four histograms): the key of a task's element is the bits of
  `|float32(x_t) - float32(b)|` (`bits & 0x7FFFFFFF`, what `abs` does to any float, NaN
  included); the rounds count `key >> 16`, `key & 0xFFFF` within a high bin, and flat
  indices (`>> 16`, `& 0xFFFF`) of keys equal to the cut, exactly as `topk` does.
- Merge: `combine.combine` op for op in float32, with TIES's keep rule
  (`topk.keep_mask`) or breadcrumbs' (`breadcrumbs.keep_mask`: in one top-k and not in
  another) and `dare.sparsify` without a rescale factor (`delta * 1.0` or `delta * 0.0`);
  sums run in task order from +0; no fastmath, so no multiply-add is contracted into an FMA
  (checked like `ram_numba`'s kernels).
- Not handled, so the eager path runs: float64 inputs, L1 rescaling, DARE's random masks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import (
    ABS32,
    LANES,
    OPTIONS,
    TILE,
    bits,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, kernel_inputs, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: HIGH's int32 sub-histograms are folded into the int64 result every FOLD elements (a
#: multiple of TILE, far below 2**31 increments per bin).
FOLD = TILE * 4096

#: Statistic kinds (the TIES reduce round that computes them).
HIGH, LOW, INDEX_HIGH, INDEX_LOW = 0, 1, 2, 3
#: Per task in the merge: keep every delta (density >= 1), none (density <= 0), TIES's
#: top-k (`cut`), or breadcrumbs' magnitudes between two cuts (in a top-k, not in another).
KEEP_ALL, KEEP_NONE, KEEP_CUT, KEEP_BETWEEN = 0, 1, 2, 3
#: A cut's threshold key that no key passes (keys are below 2**31): a top-0.
NOTHING = 1 << 31


@njit(cache=True, **OPTIONS)
def _stats_kernel(
    inputs: tuple[np.ndarray, ...], kind: int, select: np.ndarray, start: int, hist: np.ndarray
) -> None:
    """hist[t] += statistic `kind` of task t's keys (base is inputs[0]); `select[t]` is the
    high bin (LOW), the cut key (INDEX_*) or -1 to skip the task; `select[t, 1]` the index
    bin (INDEX_LOW); `start` the flat index of the first element."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    # HIGH: increments go to LANES sub-histograms in turn (int32, folded into `hist` every
    # FOLD elements): consecutive increments of one bin wait on each other, and sparse task
    # vectors (mostly zero deltas, bin 0) and narrow magnitude ranges hit few bins.
    bins = hist.shape[1]
    lanes = np.zeros((ntasks, LANES, bins if kind == 0 else 0), np.int32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        for t in range(ntasks):
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            row = hist[t]
            if kind == 0:
                sub = lanes[t]
                for i in range(m):
                    key = bits(x[i] - base[i]) & ABS32
                    sub[i & (LANES - 1), key >> np.uint32(16)] += 1
                continue
            want = select[t, 0]
            if want < 0:
                continue
            if kind == 1:
                for i in range(m):
                    key = bits(x[i] - base[i]) & ABS32
                    if np.int64(key >> np.uint32(16)) == want:
                        row[key & np.uint32(0xFFFF)] += 1
            else:
                for i in range(m):
                    key = bits(x[i] - base[i]) & ABS32
                    if np.int64(key) == want:
                        index = start + lo + i
                        if kind == 2:
                            row[index >> 16] += 1
                        elif (index >> 16) == select[t, 1]:
                            row[index & 0xFFFF] += 1
        if kind == 0 and ((lo + m) % FOLD == 0 or lo + m == n):
            for t in range(ntasks):
                for lane in range(LANES):
                    for b in range(bins):
                        hist[t, b] += lanes[t, lane, b]
                        lanes[t, lane, b] = 0


@register_jitable(inline="always")
def task_sum(vals, ntasks, m, total):  # noqa: ANN001, ANN202  (numba arrays)
    """total[:m] = `((0 + vals[1]) + vals[2]) + ...` to row `ntasks`: the task rows' float32
    sum in task order from +0 (`combine.ordered_sum`), as TIES's combine step and sce's
    election take it. Inlined where it is called (numba's IR), so each caller compiles it as
    if written there."""
    zero = np.float32(0.0)
    for i in range(m):
        total[i] = zero
    for t in range(ntasks):
        x = vals[t + 1]
        for i in range(m):
            total[i] = total[i] + x[i]


@register_jitable(inline="always")
def election_start(vals, ntasks, m, res, total, div):  # noqa: ANN001, ANN202  (numba arrays)
    """res[:m] = `task_sum`, the signed sum that elects each element's sign; total and div
    zeroed for the sums over the tasks that agree with it (TIES's and sce's elections).
    Inlined where it is called (numba's IR)."""
    task_sum(vals, ntasks, m, res)
    zero = np.float32(0.0)
    for i in range(m):
        total[i] = zero
        div[i] = zero


@register_jitable(**OPTIONS)
def combine_tile(vals, m, weights, consensus, normalize, divisor, lam, scale, total, div, res):  # noqa: ANN001, ANN201, PLR0913  (numba arrays)
    """TIES's combine step on a tile: `res[:m] = base + lambda * (sum of the weighted task
    vectors in `vals[1:]`, with sign consensus and normalized as asked)`; `vals[0]` is the
    base. Shared by the kernels of the methods built on it (TIES, DELLA), each step rounded
    as the eager rule rounds it."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    base = vals[0]
    ntasks = vals.shape[0] - 1
    if consensus:
        election_start(vals, ntasks, m, res, total, div)
        for t in range(ntasks):
            x = vals[t + 1]
            w = weights[t]
            for i in range(m):
                positive = res[i] >= zero
                d = x[i]
                agree = (d > zero) if positive else (d < zero)
                f = one if agree else zero
                total[i] = total[i] + d * f
                div[i] = div[i] + w * f
        for i in range(m):
            div[i] = one if div[i] == zero else div[i]
    else:
        task_sum(vals, ntasks, m, total)
        for i in range(m):
            div[i] = divisor
    for i in range(m):
        mixed = total[i] / div[i] if normalize else total[i]
        mixed = mixed * lam if scale else mixed
        res[i] = base[i] + mixed


@register_jitable
def combine_scratch(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`combine_tile`'s float32 work rows (total, div, res) for tiles of `width` elements."""
    return np.empty(width, np.float32), np.empty(width, np.float32), np.empty(width, np.float32)


@register_jitable
def _in_top(key: np.int64, index: int, threshold: np.int64, index_cut: np.int64) -> bool:
    """Whether an element is in a top-k (`topk.keep_mask`): its key above the threshold, or
    equal to it and its flat index below the index cut (-1: every equal key)."""
    return key > threshold or (key == threshold and (index_cut < 0 or index < index_cut))


@register_jitable(inline="always")
def delta_in_top(d: np.float32, index: int, threshold: np.int64, index_cut: np.int64) -> bool:
    """`_in_top` of the float32 delta `d` by its magnitude key (`topk.magnitude_keys`: its
    bits less the sign), as TIES's and the consensus members' keep rules take it."""
    return _in_top(np.int64(bits(d) & ABS32), index, threshold, index_cut)


@njit(cache=True, **OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...],
    keep: np.ndarray,
    cut: np.ndarray,
    start: int,
    weights: np.ndarray,
    consensus: bool,
    normalize: bool,
    divisor: np.float32,
    lam: np.float32,
    scale: bool,
    out: np.ndarray,
    nan_bits: int,
) -> None:
    """out[:] = combine(base, sparse deltas) cast to out's dtype (see the module docstring).
    keep[t] is KEEP_*; for KEEP_CUT and KEEP_BETWEEN, cut[t] = (threshold key, exclusive
    index cut or -1) of the top-k kept, then the same of a top-k dropped from it (a
    threshold of NOTHING: none); `divisor` is the plain weight sum (used without
    consensus); `scale`: multiply by lam."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    total, div, res = combine_scratch(TILE)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        # weighted_t = sparse(delta_t) * w_t, written over the task's row
        for t in range(ntasks):
            x = vals[t + 1]
            base = vals[rows[t]]  # the base at task t's precision
            w = weights[t]
            mode = keep[t]
            threshold, index_cut, above, above_cut = cut[t, 0], cut[t, 1], cut[t, 2], cut[t, 3]
            for i in range(m):
                d = x[i] - base[i]
                if mode == 2:
                    kept = delta_in_top(d, start + lo + i, threshold, index_cut)
                    d = d * (one if kept else zero)
                elif mode == 3:
                    key = np.int64(bits(d) & ABS32)
                    index = start + lo + i
                    kept = _in_top(key, index, threshold, index_cut) and not _in_top(
                        key, index, above, above_cut
                    )
                    d = d * (one if kept else zero)
                elif mode == 1:
                    d = zero
                x[i] = d * w
        tile = vals[: ntasks + 1]  # the base and the weighted task vectors
        combine_tile(tile, m, weights, consensus, normalize, divisor, lam, scale, total, div, res)
        store_span(res[:m], out, lo, nan_bits)


# ---- Python API ------------------------------------------------------------------------


def statistics(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    kind: int,
    size: int,
    select: Sequence[tuple[int, int]] | None = None,
    start: int = 0,
) -> np.ndarray:
    """int64 [N, size]: TIES round `kind` statistic of every task (rows of skipped tasks,
    `select[t][0] < 0`, are zeros), equal to `topk`'s histograms of `magnitude_keys`."""
    arrays = kernel_inputs(base, tasks)
    ntasks = len(arrays) - 1
    chosen = np.full((ntasks, 2), -1, np.int64)
    if select is not None:
        chosen[:] = np.asarray(select, dtype=np.int64).reshape(ntasks, 2)
    hist = np.zeros((ntasks, size), np.int64)
    _stats_kernel(arrays, kind, chosen, start, hist)
    return hist


def merge(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    weights: Sequence[float],
    keep: Sequence[int],
    cuts: Sequence[tuple[int, ...]],
    start: int,
    consensus: bool,
    normalize: bool,
    divisor: float,
    lambda_: float,
    bf16_nan: int | None = None,
) -> None:
    """Write `combine.combine` of the (TIES- or breadcrumbs-sparsified) task vectors into
    `out`.

    `cuts[t]`: (threshold, index cut) of TIES's top-k for KEEP_CUT; breadcrumbs' two cuts,
    (threshold, index cut) of the top-k kept then of the top-k dropped, for KEEP_BETWEEN
    (ignored for the other modes). `weights` and `divisor` (the plain weight sum, 1 where
    mergekit treats it as zero) are float32 values; `lambda_` is applied (rounded to
    float32) unless it is 1."""
    arrays, target, nan_bits, _ = merge_records(base, tasks, out, bf16_nan)
    ntasks = len(arrays) - 1
    if not len(weights) == len(keep) == len(cuts) == ntasks:
        raise ValueError(f"weights, keep and cuts must have one entry per task ({ntasks})")
    _merge_kernel(
        arrays,
        np.asarray(keep, np.int64),
        np.array([(*c, NOTHING, -1)[:4] for c in cuts], np.int64).reshape(ntasks, 4),
        start,
        np.asarray(weights, np.float32),
        consensus,
        normalize,
        np.float32(divisor),
        np.float32(lambda_),
        lambda_ != 1,
        target,
        nan_bits,
    )


KERNELS = (_stats_kernel, _merge_kernel)


def warm_calls() -> Iterator[Call]:
    """TIES's statistics and merge, once each (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    n = len(agents)
    yield _stats_kernel, "records", partial(statistics, base, agents, HIGH, 1 << 15)
    merged = partial(
        merge, base, agents, out, weights=[1.0] * n, keep=[KEEP_ALL] * n, cuts=[(-1, -1)] * n,
        start=0, consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
    )  # fmt: skip
    yield _merge_kernel, "records", merged


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
