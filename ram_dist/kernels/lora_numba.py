"""The LoRA values of `lora`'s rule (numba), byte for byte its numpy version: per tile of a
row's columns, the float32 product accumulated over k in a scratch (the inner loop runs
along the row, so it vectorizes without reordering any sum; four rows share each load of
`basis`), then each element's `float32(theta_B^t) + s * P` rounded into the task's dtype.

The base's values of a tile are loaded into a float32 scratch of `TILE` first: from a typed
array of its stored elements (bfloat16, float16, float32), or, for a quantized base (block
FP8, compressed-tensors' FP8 and packed INT4/INT8, fbgemm_fp8), from its record
(`views.kernel_record`), decoded from its codes and scales as they are loaded
(`primitives.load_span`), so no copy of the base's values is made first; then rounded to the
task's dtype where the task measures against the base at its precision (`round_bits`).
`fastmath` stays off, so no multiply and add is contracted into an FMA (`fma_instructions`
checks the compiled code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit, types
from numba.extending import overload

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import (
    F32,
    OPTIONS,
    fma_findings,
    load,
    load_span,
    round_bits,
    store,
)

if TYPE_CHECKING:
    from ram_dist.kernels.warm import Call

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


#: Columns computed at once: four rows' float32 scratch of this many stays in L1.
TILE = 256


def load_theta(theta: np.ndarray, at: int, w: int, dst: np.ndarray) -> None:
    """dst[:w] = float32 bits of the base's elements [at, at + w) of the block: a typed
    array's (`load`), or a quantized base's record's (int64: `load_span`, decoding them)."""
    raise NotImplementedError


@overload(load_theta, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_theta_impl(theta: Any, at: Any, w: Any, dst: Any) -> Callable[..., None]:
    if theta.dtype == types.int64:  # a record (`views.kernel_record`)

        def from_record(theta: Any, at: Any, w: Any, dst: Any) -> None:
            load_span(theta, at, w, dst[:w])

        return from_record

    def from_array(theta: Any, at: Any, w: Any, dst: Any) -> None:
        load(theta[at : at + w], dst[:w])

    return from_array


@njit(cache=True, **OPTIONS)
def lora_values(theta, coef, basis, scale, start, rounded, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[e] = cast(float32(theta_B^t[e]) + scale * sum_k coef[i, k] * basis[k, j])` for
    the block's flat elements `start + e = (row0 + i) * cols + j`, e < out.size, k
    ascending, each step rounded; `theta_B^t` the base's value (`theta`: a typed array or a
    record) rounded to `rounded` (a kind code, `primitives.BF16` or `F16`; `F32`: as it is).

    Whole rows go four at a time (each `basis` element loaded once for four rows), a tile of
    `TILE` columns at once; a row the elements cover in part goes alone. Every element's
    sum is the same sequence of roundings either way."""
    n = out.size
    r, cols = basis.shape
    row0 = start // cols
    acc = np.empty((4, TILE), dtype=np.float32)
    tbits = np.empty(TILE, dtype=np.uint32)
    res = np.empty(TILE, dtype=np.float32)
    e = 0
    while e < n:
        flat = start + e
        i = flat // cols - row0
        j0 = flat % cols
        m = min(cols - j0, n - e)
        rows = 4 if j0 == 0 and n - e >= 4 * cols else 1
        for jt in range(j0, j0 + m, TILE):
            w = min(TILE, j0 + m - jt)
            if rows == 4:
                c0, c1, c2, c3 = coef[i, 0], coef[i + 1, 0], coef[i + 2, 0], coef[i + 3, 0]
                for j in range(w):
                    b = basis[0, jt + j]
                    acc[0, j] = c0 * b
                    acc[1, j] = c1 * b
                    acc[2, j] = c2 * b
                    acc[3, j] = c3 * b
                for k in range(1, r):
                    c0, c1, c2, c3 = coef[i, k], coef[i + 1, k], coef[i + 2, k], coef[i + 3, k]
                    for j in range(w):
                        b = basis[k, jt + j]
                        acc[0, j] = acc[0, j] + c0 * b
                        acc[1, j] = acc[1, j] + c1 * b
                        acc[2, j] = acc[2, j] + c2 * b
                        acc[3, j] = acc[3, j] + c3 * b
            else:
                c0 = coef[i, 0]
                for j in range(w):
                    acc[0, j] = c0 * basis[0, jt + j]
                for k in range(1, r):
                    c0 = coef[i, k]
                    for j in range(w):
                        acc[0, j] = acc[0, j] + c0 * basis[k, jt + j]
            for q in range(rows):
                at = e + q * cols + (jt - j0)
                load_theta(theta, at, w, tbits)
                if rounded != F32:
                    round_bits(rounded, tbits[:w], tbits[:w])
                tvals = tbits[:w].view(np.float32)
                for j in range(w):
                    res[j] = tvals[j] + scale * acc[q, j]
                store(res[:w], out[at : at + w], -1)
        e += m if rows == 1 else 4 * cols
    return out


def fma_instructions() -> list[str]:
    """`fma_findings` of the kernel, compiled afresh (uncached, same options) for every
    signature it has been called with. Must be empty: an FMA rounds once where the spec
    rounds twice."""
    fresh = njit(cache=False, **OPTIONS)(lora_values.py_func)
    for sig in lora_values.signatures:
        fresh.compile(sig)
    return fma_findings(fresh)


def warm_calls() -> Iterator[Call]:
    """A LoRA task's values through `kernels.lora`: over a base stored in the task's dtype
    (typed arrays, one signature per dtype: its spans of 256 columns measured 10% slower
    taken as records), and in bfloat16 over a quantized base's record (one signature for
    every format) (`kernels.warm`)."""
    from ram_dist.kernels import READS

    for theta in READS:
        yield lora_values, f"LoRA {theta} -> {theta}", partial(_lora, theta)
    yield lora_values, "LoRA quantized -> BF16", _lora_stored


def _lora(theta: str) -> None:
    """One LoRA product through `kernels.lora`, on a 4 x 4 weight of rank 2."""
    from ram_dist.dtypes import INFO
    from ram_dist.kernels import lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    zeros = np.zeros(16 * INFO[theta].itemsize, np.uint8)
    lora.values(zeros, theta, *factors, np.float32(1), 0, theta, np.empty(64, np.uint8))


def _lora_stored() -> None:
    """One LoRA product over a 4 x 4 block FP8 base (one scale), into bfloat16."""
    from ram_dist.kernels import fp8, lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    base = fp8.Fp8Values(np.zeros(16, np.uint8), np.ones(1, np.float32), 4, (4, 4))
    lora.values(base, "F32", *factors, np.float32(1), 0, "BF16", np.empty(64, np.uint8))
