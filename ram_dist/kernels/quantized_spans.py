"""Spans of a quantized input (`quantized.QuantizedValues`, as `quantized.kernel_tuple`) decoded
into float32 bits as the fused kernels load them (numba; `primitives.load_span` calls these):
the bits of `mxfp4.decode_bf16`'s and `int_packed.decode_in`'s values, widened to float32, so
no copy of the values is made before the kernels run.

A span runs in decoded order. For INT the codes lie in that order (a row's words), so a span
reads them as it goes, one scale and zero point per run within a group. MXFP4's values are
the packed codes transposed: a run of one decoded row (a column `c` of an expert's packed
[rows, groups * 32] codes) reads one nibble from every packed row, `groups * 16` bytes apart,
and the factor of its block. The next decoded row, `c + 1`, reads the other nibble of the
same bytes and the same factors (the next 30 rows the same cache lines), so as long as a
decoded row's lines stay in cache each line comes from memory once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import types
from numba.extending import overload, register_jitable

from ram_dist.kernels.primitives import (
    INF32,
    bits,
    float32_of,
    float_bits_to_bf16,
    float_bits_to_half,
    half_to_float_bits,
)

_U32 = np.uint32
_QNAN32 = _U32(0x7FC00000)
_TOP16 = _U32(0xFFFF0000)


@register_jitable
def e2m1_bits(code: int) -> int:
    """float32 bits of an e2m1 code's magnitude (its low 3 bits: 0, 0.5, 1, 1.5, 2, 3, 4,
    6), computed rather than looked up (a lookup is a gather)."""
    k = _U32(code) & _U32(7)
    e = k >> _U32(1)
    m = k & _U32(1)
    normal = ((e + _U32(126)) << _U32(23)) | (m << _U32(22))
    return normal if e != _U32(0) else m * _U32(0x3F000000)


@register_jitable
def load_mxfp4(src: Any, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of values [lo, lo + m) of whole MXFP4 experts: `e2m1 * factor`
    with the code's sign (code 8 is -0.0), NaN (0x7FC00000, bfloat16's 0x7FC0 widened) where
    that is inf or NaN (a scale byte of 255, or beyond float32), as `mxfp4.decode_bf16`."""
    codes, factors = src[1], src[2]
    rows, cols, groups = src[6], src[7], src[8]
    plane = cols * rows
    e = lo // plane
    c = (lo - e * plane) // rows
    r = lo - e * plane - c * rows
    stride = groups * 16
    done = 0
    while done < m:
        run = min(m - done, rows - r)
        at = (e * rows + r) * groups + (c >> 5)  # the run's first block
        byte0 = at * 16 + ((c & 31) >> 1)
        shift = _U32(4 * (c & 1))
        out = dst[done : done + run]
        for i in range(run):
            code = (_U32(codes[byte0 + i * stride]) >> shift) & _U32(0xF)
            v = bits(float32_of(e2m1_bits(code)) * factors[at + i * groups])
            v = (v | ((code & _U32(8)) << _U32(28))) & _TOP16
            out[i] = _QNAN32 if (v & INF32) == INF32 else v
        done += run
        r = 0
        c += 1
        if c == cols:
            c = 0
            e += 1


def rounded(marker: Any, u: int) -> int:
    """float32 bits `u` rounded to nearest even to the dtype of `marker`'s elements (bfloat16
    as uint16, float16 as int16, float32: unchanged) and widened back (implemented below)."""
    raise NotImplementedError


@overload(rounded, jit_options={"fastmath": False, "error_model": "numpy"})
def _rounded_impl(marker: Any, u: Any) -> Any:
    if marker.dtype == types.uint16:

        def to_bf16(marker: Any, u: Any) -> int:
            return _U32(float_bits_to_bf16(u, -1)) << _U32(16)

        return to_bf16
    if marker.dtype == types.int16:

        def to_f16(marker: Any, u: Any) -> int:
            return half_to_float_bits(float_bits_to_half(u))

        return to_f16

    def same(marker: Any, u: Any) -> int:
        return _U32(u)

    return same


@register_jitable
def load_int(src: Any, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of values [lo, lo + m) of whole packed INT rows:
    `float32(q - zero) * scale` rounded to the values' dtype, as `int_packed.decode_in`
    (its numba kernel's arithmetic, `int_packed_numba`)."""
    marker, codes, scales, zeros = src[0], src[1], src[2], src[3]
    nbits, cols, groups = src[5], src[7], src[8]
    per_row = ((cols * nbits + 31) // 32) * 4
    size = cols // groups
    offset = np.int32(1) << np.int32(nbits - 1)
    per_row_scales = scales.size > groups
    row = lo // cols
    col = lo - row * cols
    done = 0
    while done < m:
        g = col // size
        run = min(m - done, (g + 1) * size - col)
        k = (row if per_row_scales else 0) * groups + g
        s = scales[k]
        z = np.int32(zeros[k]) if zeros.size else np.int32(0)
        at = row * per_row
        out = dst[done : done + run]
        if nbits == 8:
            q8 = codes[at + col : at + col + run]
            for i in range(run):
                v = np.float32(np.int32(q8[i]) - offset - z) * s
                out[i] = rounded(marker, bits(v))
        else:
            for i in range(run):
                c = col + i
                byte = np.int32(codes[at + (c >> 1)])
                q = (byte >> np.int32(4 * (c & 1))) & np.int32(15)
                v = np.float32(q - offset - z) * s
                out[i] = rounded(marker, bits(v))
        done += run
        col += run
        if col == cols:
            row += 1
            col = 0
