"""The layout of nuslerp's exact sums per column (`methods.geometric.columns`, the eager rule
and the driver's side) and the fused path's numba kernel over numpy arrays (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ram_dist import kernels

_PIECE = 21
_LIMB = 16
_LIMBS = 40
_LOWEST = 725  # float64 biased exponent of 2**-298, the smallest non-zero float32 product
_SCALE = 1075 - _LOWEST  # value = integer * 2**-_SCALE
_POS_INF, _NEG_INF, _NAN = _LIMBS, _LIMBS + 1, _LIMBS + 2
#: int64 slots of one column's sum: the limbs, then +inf, -inf and NaN counts.
SLOTS = _LIMBS + 3


def fused_column_sums(
    base: Any, tasks: Sequence[Any], pairs: list[tuple[int, int]], columns: int
) -> Any:
    """int64[len(pairs), columns, SLOTS]: `methods.geometric.columns.column_sums` of each
    pair of the task vectors of the inputs as stored (a quantized one decoded as it loads),
    by the numba kernel (no torch); None without numba."""
    kernel = kernels.numba_module("column_sums_numba")
    if kernel is None:
        return None
    from ram_dist.kernels.views import kernel_inputs

    arrays = kernel_inputs(base, tasks)
    out = np.zeros((len(pairs), columns, SLOTS), dtype=np.int64)
    index = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    kernel.column_gram(arrays, index, columns, _LOWEST, _PIECE, _LIMB, _LIMBS, out)
    return out
