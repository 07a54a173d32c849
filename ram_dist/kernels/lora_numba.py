"""The LoRA values of `lora`'s rule in one sweep per row (numba), byte for byte its numpy
version: per row, the float32 product accumulated over k in a row-wide scratch (the inner
loop runs along the row, so it vectorizes without reordering any sum), then each element's
`float32(theta) + s * P` rounded into the task's dtype. `fastmath` stays off, so no multiply
and add is contracted into an FMA (`fma_instructions` checks the compiled code).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, fma_findings, load, store

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


@njit(cache=True, **OPTIONS)
def lora_values(theta, coef, basis, scale, start, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[e] = cast(float32(theta[e]) + scale * sum_k coef[i, k] * basis[k, j])` for flat
    elements `start + e = (row0 + i) * cols + j`, k ascending, each step rounded."""
    n = theta.size
    r, cols = basis.shape
    row0 = start // cols
    acc = np.empty(cols, dtype=np.float32)
    tbits = np.empty(cols, dtype=np.uint32)
    res = np.empty(cols, dtype=np.float32)
    e = 0
    while e < n:
        flat = start + e
        i = flat // cols - row0
        j0 = flat % cols
        m = min(cols - j0, n - e)
        c = coef[i, 0]
        for j in range(m):
            acc[j] = c * basis[0, j0 + j]
        for k in range(1, r):
            c = coef[i, k]
            for j in range(m):
                acc[j] = acc[j] + c * basis[k, j0 + j]
        load(theta[e : e + m], tbits[:m])
        tvals = tbits[:m].view(np.float32)
        for j in range(m):
            res[j] = tvals[j] + scale * acc[j]
        store(res[:m], out[e : e + m], -1)
        e += m
    return out


def fma_instructions() -> list[str]:
    """`fma_findings` of the kernel, compiled afresh (uncached, same options) for every
    signature it has been called with. Must be empty: an FMA rounds once where the spec
    rounds twice."""
    fresh = njit(cache=False, **OPTIONS)(lora_values.py_func)
    for sig in lora_values.signatures:
        fresh.compile(sig)
    return fma_findings(fresh)
