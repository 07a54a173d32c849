"""compressed-tensors' `pack-quantized` INT4 and INT8 weights, decoded exactly (numpy).

A weight `N.weight` [R, C] is stored as `N.weight_packed` (int32 [R, ceil(C * bits / 32)]:
each row's codes packed densely, code `c` at bit `c * bits` of the row's little-endian
words, stored with an offset of `2**(bits - 1)`), `N.weight_scale` (one scale per row and
group of `C / G` columns, [R, G]; or one for the whole tensor), optionally
`N.weight_zero_point` (the codes of the zero points, [R, G] packed the same way along
dimension 0: [ceil(R * bits / 32), G]) and `N.weight_shape` ([R, C]). Its value is what
compressed-tensors' `PackedQuantizationCompressor.decompress` gives, computed in the
scale's dtype:

    x[r, c] = cast(float32(q[r, c] - zp[r, g]) * float32(scale[r, g]), dtype of the scale)

with `g = c // (C / G)`: the product is exact in float32 for 4- and 8-bit codes (at most 9
significant bits times a 16-bit float's 11; a float32 scale's product rounds once), so this
is one rounding to nearest even. That is the value `transformers` gives a trainer, so it is
the base's value (docs/quantized.md).

Only whole rows are decoded: a row's codes need its words from the first. For 4 and 8 bits
no code straddles a byte, so the words are read as their bytes (safetensors stores them
little-endian).
"""

from __future__ import annotations

import numpy as np

from ram_dist.kernels import fp8

#: The widths of the codes decoded here.
BITS = (4, 8)
#: The dtypes a scale is stored in, which the values are decoded in.
SCALE_DTYPES = ("BF16", "F16", "F32")


def words_per_row(cols: int, bits: int) -> int:
    """int32 words one packed row of `cols` codes takes."""
    return -(-cols * bits // 32)


def unpack_rows(words: np.ndarray, bits: int, rows: int, cols: int) -> np.ndarray:
    """The signed codes ([rows, cols] int16) of rows packed along dimension 1: `words` the
    rows' int32 words as their bytes (uint8, flat)."""
    data = words.reshape(rows, -1)
    offset = 1 << (bits - 1)
    if bits == 8:
        return data[:, :cols].astype(np.int16) - offset
    codes = np.empty((rows, data.shape[1] * 2), np.int16)
    codes[:, 0::2] = data & 0xF
    codes[:, 1::2] = data >> 4
    return codes[:, :cols] - offset


def unpack_columns(words: np.ndarray, bits: int, groups: int) -> np.ndarray:
    """The signed codes of values packed along dimension 0 ([P * 32 / bits, groups] int16):
    `words` the bytes (uint8, flat) of P rows of `groups` int32 words, where column `g`'s
    code `r` is at bit `r * bits` of its words."""
    data = words.reshape(-1, groups, 4)
    offset = 1 << (bits - 1)
    if bits == 8:
        codes = data.astype(np.int16)
    else:
        codes = np.empty((data.shape[0], groups, 8), np.int16)
        codes[:, :, 0::2] = data & 0xF
        codes[:, :, 1::2] = data >> 4
    return codes.transpose(0, 2, 1).reshape(-1, groups) - offset


def zero_rows(first: int, last: int, bits: int) -> tuple[int, int]:
    """The rows [p0, p1) of packed zero-point words that hold the zero points of rows
    [first, last)."""
    return first * bits // 32, -(-last * bits // 32)


def scale_floats(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Scale bytes as float32 values (exact)."""
    if dtype == "F16":
        return raw.view(np.float16).astype(np.float32)
    return fp8.scale_values(raw, dtype)


def in_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` rounded to nearest even to `dtype` (BF16, F16 or F32), as its bytes."""
    if dtype == "F32":
        return values.view(np.uint8)
    if dtype == "F16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).view(np.uint8)
    return fp8.scale_bytes(values, dtype)


def decode_in(
    words: np.ndarray,
    bits: int,
    rows: int,
    cols: int,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    dtype: str,
    floats: np.ndarray,
) -> np.ndarray:
    """The rows' values in `dtype` (the scale's), as bytes: `words` their packed words'
    bytes, `scales` float32 and `zeros` int16 ([rows, G], or [1, 1] for a tensor's), and
    `floats` a float32 scratch of rows * cols. By the numba kernel (`int_packed_numba`) for
    a 16-bit scale, straight into 16-bit bits; else, or without numba, by `decode` and
    `in_dtype`."""
    from ram_dist.kernels import numba_module

    kernel = numba_module("int_packed_numba") if dtype in ("BF16", "F16") else None
    n = rows * cols
    if kernel is not None:
        out = floats[: (n + 1) // 2].view(np.uint16)[:n]
        kind = kernel.BF16 if dtype == "BF16" else kernel.F16
        scales = np.ascontiguousarray(scales, np.float32)
        if zeros is not None:
            zeros = np.ascontiguousarray(zeros, np.int16)
        return kernel.decode_16(words, bits, cols, scales, zeros, kind, out).view(np.uint8)
    codes = unpack_rows(words, bits, rows, cols)
    return in_dtype(decode(codes, zeros, scales, floats), dtype)


def decode(
    codes: np.ndarray, zeros: np.ndarray | None, scales: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """float32 `(codes - zeros) * scales` into `out` (flat, codes.size long): `codes`
    [rows, cols], `scales` float32 [rows, G] (or [1, 1]) and `zeros` int [rows, G] (or [1,
    1], or None), each broadcast over its row's group of `cols / G` columns."""
    rows, cols = codes.shape
    groups = scales.shape[1]
    shaped = (rows, groups, cols // groups)
    x = out[: codes.size].reshape(shaped)
    q = codes.reshape(shaped)
    if zeros is not None:
        q = q - zeros.reshape(zeros.shape[0], groups, 1)
    np.multiply(q, scales.reshape(scales.shape[0], groups, 1), out=x, dtype=np.float32)
    return out[: codes.size]
