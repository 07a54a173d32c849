"""The precision check of a chunk (numba), `kernels.precision.check_counts` fused: per task,
the elements it changed, those whose value is the base's rounded to bfloat16 or float16
(rounding the rule cannot see: a task saved at another precision than the base it was
trained from, or a round trip through float16), and the base values that overflow the
task's precision. One sweep, in the first reduce round, over tensors where it can find
something (`precision.needs_check`): the counts are the same integers as the numpy rule's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import (
    BF16,
    F16,
    INF32,
    OPTIONS,
    TILE,
    VALUES,
    count_nonfinite,
    float_bits_to_bf16,
    float_bits_to_half,
    half_to_float_bits,
    load_tile_bases,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import kernel_inputs

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

_U32 = np.uint32


@register_jitable
def task_tests(inputs: np.ndarray) -> np.ndarray:
    """Per task, `precision.rounding_tests` of its values' dtype (its record's `VALUES`): 0
    none (a bfloat16 task), 1 bfloat16 (a float16 task), 2 bfloat16 and float16 (float32,
    FP8)."""
    ntasks = inputs.shape[0] - 1
    out = np.full(ntasks, 2, np.int64)
    for t in range(ntasks):
        values = inputs[t + 1, VALUES]
        out[t] = 0 if values == BF16 else (1 if values == F16 else 2)
    return out


@register_jitable
def check_tile(
    buf: np.ndarray,
    rows: np.ndarray,
    tests: np.ndarray,
    m: int,
    eps: np.float32,
    counts: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """counts[t] += (changed, rounding, overflow) of task t over the first `m` elements of a
    `load_tile_bases` tile (`buf`, float32 bits; task t measured against row `rows[t]`, its
    value compared with the base rounded as `tests[t]` says); `scratch` is uint32 [2, at
    least `m`]. RAM's count kernel calls it on the tile it has loaded, so that its first
    round reads and decodes each input once."""
    ntasks = rows.size
    vals = buf.view(np.float32)
    base_bits = buf[0]
    to_bf16, to_f16 = scratch[0], scratch[1]
    bf16, f16 = to_bf16.view(np.float32), to_f16.view(np.float32)
    rounded = halved = False
    for t in range(ntasks):
        x = vals[t + 1]
        at = vals[rows[t]]
        at_bits = buf[rows[t]]
        changed = 0
        over = 0  # a finite base value whose rounding to the task's dtype is not
        for i in range(m):
            changed += 1 if abs(x[i] - at[i]) > eps else 0
            finite = (base_bits[i] & INF32) != INF32
            over += 1 if finite and (at_bits[i] & INF32) == INF32 else 0
        counts[t, 0] += changed
        counts[t, 2] += over
        if changed and tests[t] > 0:
            if not rounded:  # the base rounded to bfloat16: integer steps, vectorized
                for i in range(m):
                    to_bf16[i] = _U32(float_bits_to_bf16(base_bits[i], -1)) << _U32(16)
                rounded = True
            rounding = 0
            for i in range(m):
                rounding += 1 if abs(x[i] - at[i]) > eps and x[i] == bf16[i] else 0
            if tests[t] > 1 and changed > rounding:  # float16: what bfloat16 left
                if not halved:  # the base rounded to float16, once a tile: vectorized
                    for i in range(m):
                        to_f16[i] = half_to_float_bits(float_bits_to_half(base_bits[i]))
                    halved = True
                for i in range(m):
                    moved = abs(x[i] - at[i]) > eps
                    rounding += 1 if moved and x[i] != bf16[i] and x[i] == f16[i] else 0
            counts[t, 1] += rounding


@register_jitable
def check_inputs(buf, rows, tests, m, eps, nonfinite, checks, scratch):  # noqa: ANN001, ANN201, PLR0913  (numba arrays)
    """The checks a reduce round's first sweep makes of a loaded tile, each where its counts
    are asked for (not empty): every input's NaN and Inf (`count_nonfinite`, base first) and
    each task's precision check (`check_tile`); RAM's count kernel and the agreement probe
    both make them."""
    count_nonfinite(buf, m, nonfinite)
    if checks.size:
        check_tile(buf, rows, tests, m, eps, checks, scratch)


@njit(cache=True, **OPTIONS)
def _check_kernel(inputs: tuple[Any, ...], eps: np.float32, counts: np.ndarray) -> None:
    """counts[t] += (changed, rounding, overflow) of task t over inputs = (base, tasks)."""
    n, buf, _, rows = tiles_of(inputs, TILE)
    tests = task_tests(inputs)
    scratch = np.empty((2, TILE), np.uint32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        check_tile(buf, rows, tests, m, eps, counts, scratch)


def check_counts(inputs: Sequence[Any], eps: float) -> np.ndarray:
    """int64 [N, 3]: `precision.check_counts` of the inputs (base first) as the kernels read
    them (an FP8 input as stored, `fp8.Fp8Values`)."""
    arrays = kernel_inputs(inputs[0], list(inputs[1:]))
    counts = np.zeros((len(arrays) - 1, 3), np.int64)
    _check_kernel(arrays, np.float32(eps), counts)
    return counts


KERNELS = (_check_kernel,)


def warm_calls() -> Iterator[Call]:
    """The precision check's kernel, once (`kernels.warm`)."""
    from ram_dist.kernels.warm import EPS, sample

    base, agents, _ = sample()
    yield _check_kernel, "records", partial(check_counts, [base, *agents], EPS)


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
