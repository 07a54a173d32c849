"""Exact sums of products of the vectors a method's statistics are of (numba), read from the
inputs' records (`views.kernel_inputs`): model_stock's and the geometric methods' Gram
matrices (whole tensors, or per row: model_stock's `filter_wise`, nuslerp's rows) and sce's
sums of squares, bin for bin `methods.exact_sums`' torch rule on the eager path's vectors.

A quantized input (block FP8, compressed-tensors FP8, MXFP4, packed INT) is decoded as its
tile loads (`primitives.load_tile_bases`), so no float32 copy of any input is made: each tile
of `exact_sums_numba.TILE` elements is widened to float32, the vectors formed from it op by
op as the eager rule forms them (`methods.task_vectors`), each one float32 rounding:

* `DELTAS`: the task vectors, `x_t - cast(x_B, p_t)`;
* `PAIR`: the base and the one model's value, `x_B + (x_1 - cast(x_B, p_1))` where the
  model measures against the base rounded to its dtype, else `x_1` (`task_values`);
* `MODELS`: the models' values, `x_t`.

The tile's products are then binned by `exact_sums_numba`'s tile step (`_tile`, `_flush`),
the very code its `gram` and `row_gram` run on float32 rows. No fastmath (no FMA).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.exact_sums import _POS_INF, _SPLIT, BINS
from ram_dist.kernels.exact_sums_numba import TILE, _flush, _tile, _work
from ram_dist.kernels.primitives import OPTIONS, load_tile_bases, tiles_of
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, input_size, kernel_inputs

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: The vectors summed (`blend_numba`'s values for the same vectors).
DELTAS, PAIR, MODELS = 0, 1, 2


@register_jitable
def vectors(vals, rows, mode, m, stack):  # noqa: ANN001, ANN202  (numba arrays)
    """stack[:, :m] = the float32 vectors of a `load_tile_bases` tile (see the module)."""
    if mode == 1:
        b, x, at = vals[0], vals[1], vals[rows[0]]
        first, second = stack[0], stack[1]
        for i in range(m):
            first[i] = b[i]
        if rows[0] == 0:
            for i in range(m):
                second[i] = x[i]
        else:
            for i in range(m):
                second[i] = b[i] + (x[i] - at[i])
        return
    for t in range(stack.shape[0]):
        x, dst = vals[t + 1], stack[t]
        if mode == 0:
            at = vals[rows[t]]  # the base at task t's precision
            for i in range(m):
                dst[i] = x[i] - at[i]
        else:
            for i in range(m):
                dst[i] = x[i]


@njit(cache=True, **OPTIONS)
def _gram_kernel(inputs, mode, pairs, row, split, special, out):  # noqa: ANN001, ANN201, PLR0913
    """out[r, k] += the bins of `sum_e v_i[e] * v_j[e]` over row r of `row` elements (the
    whole input where `row` is 0), for each pair `(i, j) = pairs[k]` of the vectors of
    `inputs` (base first) that `mode` says."""
    ntasks = inputs.shape[0] - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    stack = np.empty((2 if mode == 1 else ntasks, TILE), np.float32)
    stack_bits = stack.view(np.uint32)
    tile, keys, scratch, bounds = _work(stack, pairs)
    length = n if row == 0 else row
    for r in range(n // length if length else 0):
        for lo in range(r * length, (r + 1) * length, TILE):
            w = min(TILE, (r + 1) * length - lo)
            load_tile_bases(inputs, lo, w, buf)
            vectors(vals, rows, mode, w, stack)
            _tile(stack, stack_bits, 0, w, pairs, split, special, tile, keys, scratch, bounds,
                  out[r])  # fmt: skip
        _flush(scratch, bounds, split, out[r])


def gram(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    mode: int,
    pairs: Sequence[tuple[int, int]],
    row: int = 0,
) -> np.ndarray:
    """int64[rows, len(pairs), BINS]: the exact sums of each pair's products of the vectors
    `mode` says (see the module), per whole row of `row` elements (0: one row, the whole
    input), from the inputs as stored (FP8 and quantized ones decoded as they load)."""
    arrays = kernel_inputs(base, tasks)
    n = input_size(arrays[0])
    length = n if row == 0 else row
    if length and n % length:
        raise ValueError(f"{n} elements are not whole rows of {length}")
    vectors = 2 if mode == PAIR else len(tasks)
    index = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    if index.size and (index.min() < 0 or index.max() >= vectors):
        raise ValueError(f"pairs {list(pairs)} of {vectors} vectors")
    out = np.zeros((n // length if length else 1, len(index), BINS), dtype=np.int64)
    _gram_kernel(arrays, np.int64(mode), index, np.int64(row), _SPLIT, _POS_INF, out)
    return out


KERNELS = (_gram_kernel,)


def warm_calls() -> Iterator[Call]:
    """The vectors' exact sums from records (the mode and row are values: one signature),
    once (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, _ = sample()
    yield _gram_kernel, "records", partial(gram, base, agents, DELTAS, [(0, 0)])


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
