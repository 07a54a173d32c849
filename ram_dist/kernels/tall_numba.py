"""Fused CPU kernel (numba) for the map pass of mergekitty's consensus members
(`consensus_ta`, `consensus_ties`: TALL masks), byte-identical to the eager torch path
(`family.TaskArithmeticFamily._tall_chunk` and `tall.py` in
`ram_dist.methods.generalized_task_arithmetic`).

Eager, a chunk costs a dozen float32 passes over the block per task (the task vectors, the
magnitude keys and keep masks of TIES's cut, the weighted vectors, the sign election's
sums, then per task the mask's difference, absolute values, product and comparison, and an
int64 count). This kernel reads each input element once in its stored dtype (`primitives`'
tile loaders) and runs every step on a tile held in L2, writing the output dtype directly.
Per tile, op for op in float32 (no fastmath: no multiply-add is contracted into an FMA):

- `whole_t = delta_t` (times the task's float32 L1 factor where `rescale` gave one, as
  mergekitty scales it in place), and `sparse_t = whole_t * 1.0` or `* 0.0` by TIES's keep
  rule (`topk.keep_mask` of `delta_t`'s magnitude keys; a task with no cut: `whole_t`);
- `mixed`: `ties_numba.combine_tile`, TIES's combine step, on `sparse_t * w_t`, with lambda
  1 and a base row of -0.0 (the identity of float32 addition, signed zeros included, so
  the sum it returns is `mixed` itself);
- the count of tasks with `|whole_t| > lambda_t * |mixed - whole_t|` (strict, `lambda_t`
  rounded to float32), then `base + mixed * float32(count >= k)` (a dropped negative
  `mixed` gives -0.0, as the eager product does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, TILE, load_tile_bases, store_span, tiles_of
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.ties_numba import combine_scratch, combine_tile, delta_in_top
from ram_dist.kernels.views import ArrayLike, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: A task's cut where it has none (every delta kept, untouched): a threshold below zero.
NO_CUT = (-1, -1)


@njit(cache=True, **OPTIONS)
def _tall_kernel(
    inputs: tuple[np.ndarray, ...],
    cut: np.ndarray,
    factors: np.ndarray,
    start: int,
    weights: np.ndarray,
    lambdas: np.ndarray,
    k: int,
    flags: np.ndarray,
    divisor: np.float32,
    out: np.ndarray,
    nan_bits: int,
) -> None:
    """out[:] = the consensus merge cast to out's dtype (see the module docstring).
    cut[t] = (threshold key, exclusive index cut or -1) of task t's top-k, or a threshold
    below zero for no cut, then 1 where its vector is scaled by factors[t] (its L1 factor),
    else 0; flags = (consensus, normalize); `divisor`: the plain weight sum (used without
    consensus)."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    total, div, mixed = combine_scratch(TILE)
    tile = np.empty((ntasks + 1, TILE), np.float32)  # -0.0, then the weighted sparse vectors
    tile[0, :] = np.float32(-0.0)
    count = np.empty(TILE, np.int64)
    consensus, normalize = flags[0] != 0, flags[1] != 0
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        for t in range(ntasks):
            x = vals[t + 1]  # becomes whole_t
            base = vals[rows[t]]  # the base at task t's precision
            weighted = tile[t + 1]
            w = weights[t]
            f = factors[t]
            threshold, index_cut, scaled = cut[t, 0], cut[t, 1], cut[t, 2] != 0
            if threshold < 0:
                for i in range(m):
                    d = x[i] - base[i]
                    x[i] = d
                    weighted[i] = d * w
                continue
            for i in range(m):
                d = x[i] - base[i]
                kept = delta_in_top(d, start + lo + i, threshold, index_cut)
                whole = d * f if scaled else d
                x[i] = whole
                weighted[i] = (whole * (one if kept else zero)) * w
        combine_tile(tile, m, weights, consensus, normalize, divisor, one, False, total, div, mixed)
        for i in range(m):
            count[i] = 0
        for t in range(ntasks):
            x = vals[t + 1]
            lam = lambdas[t]
            for i in range(m):
                if abs(x[i]) > lam * abs(mixed[i] - x[i]):
                    count[i] += 1
        b = vals[0]
        for i in range(m):
            total[i] = b[i] + mixed[i] * (one if count[i] >= k else zero)
        store_span(total[:m], out, lo, nan_bits)


# ---- Python API ------------------------------------------------------------------------


def merge(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    weights: Sequence[float],
    cuts: Sequence[tuple[int, int]],
    factors: Sequence[float | None],
    lambdas: Sequence[float],
    k: int,
    start: int,
    consensus: bool,
    normalize: bool,
    divisor: float,
    bf16_nan: int | None = None,
) -> None:
    """Write the consensus merge of the tasks into `out`: `cuts[t]` = (threshold, index cut)
    of TIES's top-k for task t, `NO_CUT` to keep its vector whole; `factors[t]` its L1
    factor (None: none); `weights`, `lambdas` and `divisor` (the plain weight sum, 1 where
    mergekit treats it as zero) are rounded to float32; `k` the tasks whose masks must
    hold."""
    arrays, target, nan_bits, _ = merge_records(base, tasks, out, bf16_nan)
    ntasks = len(arrays) - 1
    if not len(weights) == len(cuts) == len(factors) == len(lambdas) == ntasks:
        raise ValueError(f"weights, cuts, factors and lambdas need one entry per task ({ntasks})")
    _tall_kernel(
        arrays,
        np.array([(*c, f is not None) for c, f in zip(cuts, factors, strict=True)], np.int64),
        np.array([1.0 if f is None else f for f in factors], np.float32),
        start,
        np.asarray(weights, np.float32),
        np.asarray(lambdas, np.float32),
        k,
        np.array([consensus, normalize], np.int64),
        np.float32(divisor),
        target,
        nan_bits,
    )


KERNELS = (_tall_kernel,)


def warm_calls() -> Iterator[Call]:
    """The consensus merge, once (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    n = len(agents)
    merged = partial(
        merge, base, agents, out, weights=[1.0] * n, cuts=[NO_CUT] * n, factors=[None] * n,
        lambdas=[1.0] * n, k=1, start=0, consensus=True, normalize=True, divisor=1.0,
    )  # fmt: skip
    yield _tall_kernel, "records", merged


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
