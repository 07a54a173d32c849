"""Exact sums of float32 products down the columns of a matrix (numba), limb for limb the
torch rule of `methods.geometric.columns` (nuslerp's vectors along the first dimension):
each product formed in float64 (exact), its integer significand cut into pieces of `piece`
bits, each shifted into place and added whole to the lowest int64 limb of `limb` bits it
reaches; infinities and NaN counted in three slots after the limbs. The layout is
`methods.geometric.columns`'; this kernel takes it as arguments. Products go a tile at a
time through a float64 scratch whose bits are read as int64, so no float is rounded here.

The vectors are the task vectors of the inputs as stored (records, `views.kernel_inputs`):
each tile is loaded with the base at each task's precision (`primitives.load_tile_bases`, a
quantized input decoded as it loads, no float32 copy of any input) and its task vectors
formed as the eager rule forms them (`vector_sums_numba`'s `DELTAS`).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, load_tile_bases, tiles_of
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.vector_sums_numba import DELTAS, vectors

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Products formed at once in the float64 scratch.
TILE = 512
_FRAC = (1 << 52) - 1


@njit(cache=True, **OPTIONS)
def column_gram(inputs, pairs, columns, lowest, piece, limb, limbs, out):  # noqa: ANN001, ANN201
    """`out[k, c] +=` the limbs of `sum_r v_i[r * columns + c] * v_j[...]` for each pair
    `(i, j) = pairs[k]` of the task vectors of `inputs` (records, base first; whole rows of
    `columns`)."""
    ntasks = inputs.shape[0] - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    stack = np.empty((ntasks, TILE), np.float32)
    scratch = np.empty(TILE, dtype=np.float64)
    raw = scratch.view(np.int64)
    piece_mask = (np.int64(1) << piece) - 1
    shift_mask = limb - 1
    for lo in range(0, n, TILE):
        w = min(TILE, n - lo)
        load_tile_bases(inputs, lo, w, buf)
        vectors(vals, rows, DELTAS, w, stack)
        for k in range(pairs.shape[0]):
            i, j = pairs[k, 0], pairs[k, 1]
            for t in range(w):
                scratch[t] = np.float64(stack[i, t]) * np.float64(stack[j, t])
            for t in range(w):
                b = raw[t]
                c = (lo + t) % columns
                exponent = (b >> 52) & 0x7FF
                frac = b & _FRAC
                if exponent == 0x7FF:
                    if frac != 0:
                        out[k, c, limbs + 2] += 1
                    elif b < 0:
                        out[k, c, limbs + 1] += 1
                    else:
                        out[k, c, limbs] += 1
                    continue
                sig = frac | (np.int64(1) << 52) if exponent > 0 else frac
                q = exponent - lowest if exponent > lowest else 0
                for p in range(3):
                    part = (sig >> (piece * p)) & piece_mask
                    place = q + piece * p
                    addend = part << (place & shift_mask)
                    out[k, c, place // limb] += -addend if b < 0 else addend


def warm_calls() -> Iterator[Call]:
    """nuslerp's exact sums per column (its compact limbs; records: one signature), through
    `kernels.column_sums` (`kernels.warm`)."""
    from ram_dist.kernels import column_sums, exact_sums
    from ram_dist.kernels.warm import N, sample

    base, agents, _ = sample()
    by_column = partial(column_sums.fused_column_sums, base, agents, exact_sums.pairs_of(1), N // 2)
    yield column_gram, "exact sums per column", by_column


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
