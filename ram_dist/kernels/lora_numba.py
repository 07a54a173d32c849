"""The LoRA values of `lora`'s rule (numba), byte for byte its numpy version: per tile of a
row's columns, the float32 product accumulated over k in a scratch (the inner loop runs
along the row, so it vectorizes without reordering any sum; four rows share each load of
`basis`), then each element's `float32(theta) + s * P` rounded into the task's dtype.
`fastmath` stays off, so no multiply and add is contracted into an FMA (`fma_instructions`
checks the compiled code).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, fma_findings, load, store

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
