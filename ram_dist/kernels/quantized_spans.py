"""Spans of a quantized input (`quantized.QuantizedValues`, as its record,
`views.kernel_inputs`) decoded into float32 bits as the fused kernels load them (numba;
`primitives.load_span` calls these):
the bits of `mxfp4.decode_bf16`'s, `int_packed.decode_in`'s and a rounded FP8 source's
(`Fp8Source.decode`) values, widened to float32, so no copy of the values is made before the
kernels run.

A span runs in decoded order. For INT and FP8 the codes lie in that order (a row's words), so a span
reads them as it goes, one scale and zero point per run within a group. MXFP4's values are
the packed codes transposed: decoded row `c` of an expert is column `c` of its packed
[rows, groups * 32] codes, one nibble from every packed row, `groups * 16` bytes apart. Read
that way, a decoded row touches a cache line per value (and, for gpt-oss-120b, a page every
third), and the kernels measured 3 to 5 times slower than on a bf16 base. So the 32
decoded rows of one group are decoded at once, when a span first needs one of them, into a
panel of bfloat16 bits ([32, rows], 360 KiB at most for gpt-oss-120b: in L2) that the tuple
carries, reading each packed row's 16 bytes once and in order, each value looked up by its scale
byte and code in a table of every MXFP4 value's bits (`BF16_OF`); the spans of those rows
then read the panel contiguously. The kernels walk the values in order, so each group is decoded
once a pass.
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

from ram_dist.kernels import quantized
from ram_dist.kernels.primitives import (
    BITS,
    COLS,
    DATA,
    FORMAT,
    GROUPS,
    INF32,
    KEY,
    PANEL,
    ROWS,
    SCALES,
    VALUES,
    ZEROS,
    bits,
    e4m3_bits,
    field_bytes,
    float32_of,
    round_bits,
)

_U32 = np.uint32


@register_jitable
def e2m1_bits(code: int) -> int:
    """float32 bits of an e2m1 code's magnitude (its low 3 bits: 0, 0.5, 1, 1.5, 2, 3, 4,
    6), from its exponent and mantissa bits (`BF16_OF`'s magnitudes)."""
    k = _U32(code) & _U32(7)
    e = k >> _U32(1)
    m = k & _U32(1)
    normal = ((e + _U32(126)) << _U32(23)) | (m << _U32(22))
    return normal if e != _U32(0) else m * _U32(0x3F000000)


@register_jitable
def load_mxfp4(src: np.ndarray, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of values [lo, lo + m) of whole MXFP4 experts (as
    `mxfp4.decode_bf16`'s, widened), from their record: each run of one decoded row from
    the record's panel, which `fill_panel` fills with the row's 32-row group the first time
    a run of it is asked for (the record's `KEY` says which group it holds)."""
    panel = field_bytes(src, PANEL).view(np.uint16)
    rows, cols, groups = src[ROWS], src[COLS], src[GROUPS]
    plane = cols * rows
    e = lo // plane
    c = (lo - e * plane) // rows
    r = lo - e * plane - c * rows
    done = 0
    while done < m:
        run = min(m - done, rows - r)
        group = e * groups + (c >> 5)
        if src[KEY] != group:
            codes = field_bytes(src, DATA)
            fill_panel(codes, field_bytes(src, SCALES).view(np.float32), e, c >> 5, rows,
                       groups, panel)  # fmt: skip
            src[KEY] = group
        at = (c & 31) * rows + r
        got = panel[at : at + run]
        out = dst[done : done + run]
        for i in range(run):
            out[i] = _U32(got[i]) << _U32(16)
        done += run
        r = 0
        c += 1
        if c == cols:
            c = 0
            e += 1


@register_jitable
def fill_panel(
    codes: np.ndarray,
    factors: np.ndarray,
    e: int,
    g: int,
    rows: int,
    groups: int,
    panel: np.ndarray,
) -> None:
    """panel[k * rows + r] = the bfloat16 bits of expert e's decoded row 32 * g + k, every r
    (`BF16_OF`'s entry for the packed row's scale byte and the value's code). Each packed
    row's 16 bytes of the group are read once, in order, and unpacked into a [32, `_TILE`]
    scratch that stays in L1, then written out as 32 contiguous runs: unpacked straight into
    the panel, a packed row's 32 values land `rows` apart, for gpt-oss's sizes a multiple
    of 4 KiB, one L1 set (the decode measured ten times slower)."""
    tile = np.empty((32, _TILE), np.uint16)
    for r0 in range(0, rows, _TILE):
        n = min(_TILE, rows - r0)
        for j in range(n):
            at = (e * rows + r0 + j) * groups + g
            s = bits(factors[at]) >> _U32(23)  # the scale byte (`quantized.mxfp4_factors`)
            lut = BF16_OF[s * _U32(16) : s * _U32(16) + _U32(16)]
            packed = codes[at * 16 : at * 16 + 16]
            for k in range(16):
                byte = packed[k]
                tile[2 * k, j] = lut[byte & np.uint8(15)]
                tile[2 * k + 1, j] = lut[byte >> np.uint8(4)]
        for k in range(32):
            row = panel[k * rows + r0 : k * rows + r0 + n]
            got = tile[k]
            for i in range(n):
                row[i] = got[i]


#: Packed rows a `fill_panel` scratch holds (16 KiB; measured fastest of 32 to 256).
_TILE = 256


def _bf16_of() -> np.ndarray:
    """`BF16_OF`: `e2m1 * factor` in float32 (numpy: IEEE, no flush to zero), the code's
    sign (code 8 is -0.0), 0x7FC0 where that is inf or NaN (a scale byte of 255, or beyond
    float32), the top 16 bits, as `mxfp4.decode_bf16`."""
    magnitudes = np.array([e2m1_bits(k) for k in range(8)], np.uint32).view(np.float32)
    factors = quantized.mxfp4_factors(np.arange(256, dtype=np.uint8))
    with np.errstate(over="ignore", invalid="ignore"):
        products = (factors[:, None] * magnitudes[None, :]).view(np.uint32)
    v = np.concatenate([products, products | _U32(0x80000000)], axis=1)
    nan = (v & INF32) == INF32
    return np.where(nan, _U32(0x7FC0), v >> _U32(16)).astype(np.uint16).reshape(-1)


#: The bfloat16 bits of every MXFP4 value: entry `16 * s + code` for scale byte `s` (8 KiB,
#: in L1; a constant of the compiled kernels), so the panel's fill does no arithmetic.
BF16_OF = _bf16_of()


@register_jitable
def load_rows(src: np.ndarray, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of values [lo, lo + m) of whole packed INT rows, from their
    record: `float32(q - zero) * scale` rounded to the values' dtype, as
    `int_packed.decode_in` (its numba kernel's arithmetic, `int_packed_numba`); or, for FP8
    rows (a byte a value), `float32(e4m3) * scale` rounded to the values' dtype, as
    `Fp8Source.decode`. The products are written first, then the span rounded at once
    (`round_bits`: the values' dtype is a value, so the rounding is picked once a span)."""
    codes = field_bytes(src, DATA)
    scales = field_bytes(src, SCALES).view(np.float32)
    zeros = field_bytes(src, ZEROS).view(np.int16)
    nbits, cols, groups = src[BITS], src[COLS], src[GROUPS]
    fp8 = src[FORMAT] == 2  # quantized.FP8: e4m3 bytes, a row's `cols` bytes
    per_row = cols if fp8 else ((cols * nbits + 31) // 32) * 4
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
        if fp8:
            q8 = codes[at + col : at + col + run]
            for i in range(run):
                out[i] = bits(float32_of(e4m3_bits(q8[i])) * s)
        elif nbits == 8:
            q8 = codes[at + col : at + col + run]
            for i in range(run):
                out[i] = bits(np.float32(np.int32(q8[i]) - offset - z) * s)
        else:
            for i in range(run):
                c = col + i
                byte = np.int32(codes[at + (c >> 1)])
                q = (byte >> np.int32(4 * (c & 1))) & np.int32(15)
                out[i] = bits(np.float32(q - offset - z) * s)
        done += run
        col += run
        if col == cols:
            row += 1
            col = 0
    round_bits(src[VALUES], dst[:m], dst[:m])
