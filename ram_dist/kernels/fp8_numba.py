"""FP8 block (de)quantization in one sweep per step (numba), byte for byte `fp8`'s numpy rule.

numpy's version makes a temporary per step (the per-element scales, padded blocks, masks),
about ten passes over each element; these make one to dequantize and two to quantize. No
step can contract into a fused multiply-add: dequantizing is one multiplication per element,
quantizing one division, and `fastmath` stays off.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.shared_cache import share_compiles

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

_MAX_BITS = np.uint32(0x43E00000)  # 448.0, e4m3fn's largest finite value
_MIN_NORMAL_BITS = np.uint32(0x3C800000)  # 2**-6, e4m3fn's smallest normal value
_INF_BITS = np.uint32(0x7F800000)


@njit(cache=True, nogil=True, fastmath=False)
def dequantize(q, scales, cols, bm, bn, lut, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[i*cols + j] = lut[q[i*cols + j]] * scales[(i // bm) * nb + j // bn]`."""
    rows = q.size // cols
    nb = (cols + bn - 1) // bn
    for i in range(rows):
        srow = (i // bm) * nb
        at = i * cols
        for cb in range(nb):
            s = scales[srow + cb]
            for j in range(at + cb * bn, at + min(cb * bn + bn, cols)):
                out[j] = lut[q[j]] * s
    return out


@njit(cache=True, nogil=True, fastmath=False)
def block_stats(y, base_x, cols, bm, bn, amax, same):  # noqa: ANN001, ANN201
    """Per block: `amax` = max |y| (NaN when any y is NaN) and `same` = 1 when y equals
    `base_x` bit for bit (both given as uint32 views too: `y`, `base_x` are float32)."""
    yb = y.view(np.uint32)
    xb = base_x.view(np.uint32)
    rows = y.size // cols
    nb = (cols + bn - 1) // bn
    for k in range(amax.size):
        amax[k] = 0.0
        same[k] = 1
    for i in range(rows):
        b = (i // bm) * nb
        at = i * cols
        for cb in range(nb):
            m = amax[b + cb]
            eq = same[b + cb]
            for j in range(at + cb * bn, at + min(cb * bn + bn, cols)):
                a = abs(y[j])
                if a > m or a != a:
                    if m == m:  # NaN is sticky, as numpy's max
                        m = a
                if yb[j] != xb[j]:
                    eq = 0
            amax[b + cb] = m
            same[b + cb] = eq


@njit(cache=True, nogil=True, fastmath=False)
def encode(y, divisor, same, base_q, cols, bm, bn, out):  # noqa: ANN001, ANN201
    """e4m3fn bytes of `y / divisor[block]` (nearest, ties to even, saturated to +-448) into
    `out`; the base's bytes where the block is `same`."""
    rows = y.size // cols
    nb = (cols + bn - 1) // bn
    quotient = np.empty(cols, dtype=np.float32)  # one row, reused: stays in cache
    bits = quotient.view(np.uint32)
    for i in range(rows):
        b = (i // bm) * nb
        at = i * cols
        for cb in range(nb):
            s = divisor[b + cb]
            for j in range(cb * bn, min(cb * bn + bn, cols)):
                quotient[j] = y[at + j] / s
        for cb in range(nb):
            lo, hi = cb * bn, min(cb * bn + bn, cols)
            if same[b + cb]:
                for j in range(lo, hi):
                    out[at + j] = base_q[at + j]
                continue
            for j in range(lo, hi):  # branch-free uint32 arithmetic: vectorizes
                v = bits[j]
                mag = v & np.uint32(0x7FFFFFFF)
                normal = ((mag + np.uint32(0x7FFFF) + ((mag >> 20) & np.uint32(1))) >> 20) - (
                    np.uint32(960)
                )
                # below 2**-6: multiples of 2**-9, |q| * 512 exact and below 8 (ties to even)
                a = abs(quotient[j])
                a = a if a < np.float32(1.0) else np.float32(1.0)  # NaN too: never chosen
                small = np.uint32(np.rint(a * np.float32(512.0)))
                code = normal if mag >= _MIN_NORMAL_BITS else small
                code = np.uint32(0x7E) if mag >= _MAX_BITS else code
                code = np.uint32(0x7F) if mag > _INF_BITS else code
                out[at + j] = np.uint8(code | ((v >> 24) & np.uint32(0x80)))


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
