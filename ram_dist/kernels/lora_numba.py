"""The LoRA values of `lora`'s rule (numba), byte for byte its numpy version: per tile of a
row's columns, the float32 product accumulated over k in a scratch (the inner loop runs
along the row, so it vectorizes without reordering any sum; four rows share each load of
`basis`), then each element's `float32(theta) + s * P` rounded into the task's dtype.
`fastmath` stays off, so no multiply and add is contracted into an FMA (`fma_instructions`
checks the compiled code).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, fma_findings, load, store

if TYPE_CHECKING:
    from ram_dist.kernels.warm import Call

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


#: Columns computed at once: four rows' float32 scratch of this many stays in L1.
TILE = 256


@njit(cache=True, **OPTIONS)
def lora_values(theta, coef, basis, scale, start, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[e] = cast(float32(theta[e]) + scale * sum_k coef[i, k] * basis[k, j])` for flat
    elements `start + e = (row0 + i) * cols + j`, k ascending, each step rounded.

    Whole rows go four at a time (each `basis` element loaded once for four rows), a tile of
    `TILE` columns at once; a row the elements cover in part goes alone. Every element's
    sum is the same sequence of roundings either way."""
    n = theta.size
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
                load(theta[at : at + w], tbits[:w])
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
    """A LoRA task's values through `kernels.lora`, per pair of dtypes: in the base's dtype,
    and bfloat16 over an FP8 base's float32 (typed arrays: its spans of 256 columns measured
    10% slower taken as records) (`kernels.warm`)."""
    from ram_dist.kernels import READS

    for theta, to in [*((d, d) for d in READS), ("F32", "BF16")]:
        yield lora_values, f"LoRA {theta} -> {to}", partial(_lora, theta, to)


def _lora(theta: str, out: str) -> None:
    """One LoRA product through `kernels.lora`, on a 4 x 4 weight of rank 2."""
    from ram_dist.dtypes import INFO
    from ram_dist.kernels import lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    zeros = np.zeros(16 * INFO[theta].itemsize, np.uint8)
    lora.values(zeros, theta, *factors, np.float32(1), 0, out, np.empty(64, np.uint8))
