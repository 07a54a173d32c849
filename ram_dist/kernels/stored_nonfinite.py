"""NaN and Inf counts of a quantized input from its stored form, without decoding it: the
first reduce round's check (`engine.reduce_step`) for a method whose own sweep does not
count them (every method but the RAM family's), numpy only.

A decoded value is a code times its group's scale (`docs/quantized.md`), so where it is not
finite the stored bytes say so (spec: a NaN code or scale, or a value that overflows, is
refused naming the tensor):

- block FP8 and fbgemm (`fp8.Fp8Values`, `float32(e4m3) * s`): an e4m3fn NaN code (0x7F,
  0xFF; e4m3fn has no infinity), every value of a group whose scale is not finite (a zero
  code times inf is NaN), or a product beyond float32;
- compressed-tensors' FP8 (`quantized` FP8: that product rounded to the scale's dtype): the
  same, with "beyond" the rounded dtype's largest value;
- MXFP4 (`2**(e8m0 - 127) * e2m1`): every value of a scale byte of 255 (e8m0's NaN, an
  infinite factor), or a product beyond float32 (only near the top scale bytes);
- packed INT (`float32(q - zero) * s` rounded to the scale's dtype): a scale that is not
  finite, or a product beyond the rounded dtype's largest value.

Rounding to nearest is monotonic, so a group whose largest possible magnitude (the largest
code's times its scale) decodes finite holds no overflow at all: that bound, one value per
scale, clears the usual block, and the count is then its NaN codes (FP8) or 0. Only a block
with a group that fails it has its values computed here, from its codes and scales by the
format's rule, to count them exactly.
"""

from __future__ import annotations

import numpy as np

from ram_dist.dtypes import INFO, ITEMSIZE
from ram_dist.kernels import fp8, int_packed, mxfp4, quantized

#: The largest e4m3fn and e2m1 magnitudes.
E4M3_TOP, E2M1_TOP = np.float32(448.0), np.float32(6.0)


def count(form: object) -> int | None:
    """Non-finite values in a stored form (`TensorSource.encoded`), or None for a form this
    does not know (the values must then be decoded to be counted)."""
    if isinstance(form, fp8.Fp8Values):
        return _block_fp8(form)
    if isinstance(form, quantized.QuantizedValues):
        if form.format == quantized.MXFP4:
            return _mxfp4(form)
        if form.format == quantized.FP8:
            return _rounded_fp8(form)
        if form.format == quantized.INT:
            return _int(form)
    return None


def _nonfinite_in(values: np.ndarray, dtype: str) -> int:
    """Non-finite values among float32 `values` once rounded to nearest even to `dtype`."""
    raw = int_packed.in_dtype(np.ascontiguousarray(values, np.float32).reshape(-1), dtype)
    bits = raw.view(np.dtype(f"u{ITEMSIZE[dtype]}"))
    mask = bits.dtype.type(INFO[dtype].exponent)
    return int(np.count_nonzero((bits & mask) == mask))


def _all_finite(scales: np.ndarray, top: np.float32, dtype: str) -> bool:
    """Whether `top` times every scale's magnitude, rounded to `dtype`, is finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        bound = np.abs(scales.astype(np.float32, copy=False)) * top
    return _nonfinite_in(bound, dtype) == 0


def _nan_codes(q: np.ndarray) -> int:
    return int(np.count_nonzero((q.reshape(-1) & 0x7F) == 0x7F))


def _block_fp8(x: fp8.Fp8Values) -> int:
    bm, bn = x.block
    rows = x.size // x.cols
    bands, per_band = -(-rows // bm), -(-x.cols // bn)
    scales = x.scales.reshape(-1)[: bands * per_band]
    if _all_finite(scales, E4M3_TOP, "F32"):
        return _nan_codes(x.q)
    grid = scales.reshape(bands, per_band)
    s = np.repeat(np.repeat(grid, bm, axis=0)[:rows], bn, axis=1)[:, : x.cols]
    with np.errstate(over="ignore", invalid="ignore"):
        values = fp8.E4M3_VALUES[x.q.reshape(rows, x.cols)] * s
    return _nonfinite_in(values, "F32")


def _rounded_fp8(x: quantized.QuantizedValues) -> int:
    scales = x.scales.reshape(-1)
    if _all_finite(scales, E4M3_TOP, x.values_dtype):
        return _nan_codes(x.codes[: x.size])
    per_row = scales.reshape(-1, 1)  # a scale per row, or one for the tensor
    with np.errstate(over="ignore", invalid="ignore"):
        values = fp8.E4M3_VALUES[x.codes[: x.size].reshape(x.rows, x.cols)] * per_row
    return _nonfinite_in(values, x.values_dtype)


def _mxfp4(x: quantized.QuantizedValues) -> int:
    factors = x.scales.reshape(-1)
    if _all_finite(factors, E2M1_TOP, "F32"):
        return 0
    data = x.codes.reshape(factors.size, mxfp4.GROUP // 2)
    nibbles = np.empty((factors.size, mxfp4.GROUP), np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = data & 0xF, data >> 4
    with np.errstate(over="ignore", invalid="ignore"):
        values = mxfp4.E2M1[nibbles] * factors.reshape(-1, 1)
    return _nonfinite_in(values, "F32")


def _int(x: quantized.QuantizedValues) -> int:
    scales = x.scales.reshape(-1)
    zeros = x.zeros.reshape(-1) if x.zeros.size else None
    # |q - zero| is at most 2**bits - 1 (both signed codes of `bits`), |q| at most 2**(bits-1)
    top = np.float32((1 << x.bits) - 1 if zeros is not None else 1 << (x.bits - 1))
    if _all_finite(scales, top, x.values_dtype):
        return 0
    per_row = int_packed.words_per_row(x.cols, x.bits) * 4
    codes = int_packed.unpack_rows(x.codes[: x.rows * per_row], x.bits, x.rows, x.cols)
    width = x.cols // x.groups
    q = codes.reshape(x.rows, x.groups, width).astype(np.float32)
    shape = (-1, x.groups, 1)  # one row of scales broadcast over the rows (a tensor's)
    if zeros is not None:
        q = q - zeros.astype(np.float32).reshape(shape)
    with np.errstate(over="ignore", invalid="ignore"):
        values = q * scales.reshape(shape)
    return _nonfinite_in(values, x.values_dtype)
