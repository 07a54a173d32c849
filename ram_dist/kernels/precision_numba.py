"""The precision check of a chunk (numba), `kernels.precision.check_counts` fused: per task,
the elements it changed, those whose value is the base's rounded to bfloat16 or float16
(rounding the rule cannot see: a task saved at another precision than the base it was
trained from, or a round trip through float16), and the base values that overflow the
task's precision. One sweep, in the first reduce round, over tensors where it can find
something (`precision.needs_check`): the counts are the same integers as the numpy rule's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import (
    INF32,
    OPTIONS,
    TILE,
    base_rows,
    float_bits_to_bf16,
    float_bits_to_half,
    half_to_float_bits,
    load_tile_bases,
    size_of,
)
from ram_dist.kernels.views import kernel_inputs

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

_U32 = np.uint32


@njit(cache=True, **OPTIONS)
def _check_kernel(inputs: tuple[Any, ...], eps: np.float32, counts: np.ndarray) -> None:
    """counts[t] += (changed, rounding, overflow) of task t over inputs = (base, tasks)."""
    n = size_of(inputs[0])
    ntasks = len(inputs) - 1
    buf = np.empty((2 * ntasks + 1, TILE), np.uint32)  # `load_tile_bases`' rows
    vals = buf.view(np.float32)
    rows = base_rows(inputs)
    to_bf16 = np.empty(TILE, np.uint32)
    to_f16 = np.empty(TILE, np.uint32)
    bf16 = to_bf16.view(np.float32)
    f16 = to_f16.view(np.float32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        base_bits = buf[0]
        for i in range(m):
            to_bf16[i] = _U32(float_bits_to_bf16(base_bits[i], -1)) << _U32(16)
            to_f16[i] = half_to_float_bits(float_bits_to_half(base_bits[i]))
        for t in range(ntasks):
            x = vals[t + 1]
            at = vals[rows[t]]
            changed = 0
            rounding = 0
            for i in range(m):
                moved = abs(x[i] - at[i]) > eps
                changed += 1 if moved else 0
                rounding += 1 if moved and (x[i] == bf16[i] or x[i] == f16[i]) else 0
            counts[t, 0] += changed
            counts[t, 1] += rounding
            if rows[t] != 0:
                at_bits = buf[rows[t]]
                over = 0
                for i in range(m):
                    finite = (base_bits[i] & INF32) != INF32
                    over += 1 if finite and (at_bits[i] & INF32) == INF32 else 0
                counts[t, 2] += over


def check_counts(inputs: Sequence[Any], eps: float) -> np.ndarray:
    """int64 [N, 3]: `precision.check_counts` of the inputs (base first) as the kernels read
    them (an FP8 input as stored, `fp8.Fp8Values`)."""
    arrays = kernel_inputs(inputs[0], list(inputs[1:]))
    counts = np.zeros((len(arrays) - 1, 3), np.int64)
    _check_kernel(arrays, np.float32(eps), counts)
    return counts


KERNELS = (_check_kernel,)
