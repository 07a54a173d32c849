"""The first round's NaN/Inf count of a quantized input from its stored form
(`kernels.stored_nonfinite`) is the count of its decoded values, per format, on finite
inputs and on each way a decoded value is not finite: an e4m3fn NaN code (0x7F, 0xFF), a
scale that is NaN or infinite (every value of its group, zeros included), a product beyond
float32, and one beyond the 16-bit dtype it is rounded to (a bf16 or f16 scale; the tie
that rounds to infinity); MXFP4's scale byte 255 and its top scale bytes. Each case's count
is also the one the case was built to have.

The decoded values come from the engine's decoders (`fp8.dequantize`, `mxfp4.decode_bf16`,
`int_packed.decode_in`: what the check decoded until now)."""

from __future__ import annotations

import numpy as np
import pytest

from ram_dist.kernels import fp8, int_packed, mxfp4, quantized, stored_nonfinite

pytestmark = pytest.mark.quick

EXP = {"BF16": 0x7F80, "F16": 0x7C00}


def _rng() -> np.random.Generator:
    return np.random.default_rng(7)


def _finite_codes(n: int) -> np.ndarray:
    """e4m3fn codes, none a NaN."""
    codes = _rng().integers(0, 256, n).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11
    return codes


def _count_decoded(raw: np.ndarray, dtype: str) -> int:
    if dtype == "F32":
        return int(np.count_nonzero(~np.isfinite(raw.view(np.float32))))
    bits = raw.view(np.uint16)
    return int(np.count_nonzero((bits & EXP[dtype]) == EXP[dtype]))


# ---- block FP8 and fbgemm: float32(e4m3) * s -----------------------------------------------

ROWS, COLS, BLOCK = 6, 10, (4, 4)  # ragged bands and blocks: 2 x 3 scales
HUGE = np.float32(1e37)  # 448 * HUGE is beyond float32; |v| >= 34.03 overflows


def _fp8_case(case: str) -> tuple[fp8.Fp8Values, int]:
    q = _finite_codes(ROWS * COLS)
    s = (_rng().random(6).astype(np.float32) + np.float32(0.5)) * np.float32(0.01)
    want = 0
    if case == "nan codes":
        q[[3, 17, 59]] = [0x7F, 0xFF, 0x7F]
        want = 3
    elif case in ("nan scale", "inf scale", "-inf scale"):
        s[4] = {"nan scale": np.nan, "inf scale": np.inf, "-inf scale": -np.inf}[case]
        q[4 * COLS + 4] = 0  # a zero code: 0 * inf is NaN too
        want = 2 * 4  # block (1, 1): rows 4-5, columns 4-7
    elif case == "overflow":
        s[0] = HUGE
        band = q.reshape(ROWS, COLS)[:4, :4]
        band[:] = [[0x00, 0x80, 0x30, 0xB0], [0x6F, 0xEF, 0x7E, 0xFE], [0x58, 0x59, 0, 0],
                   [0x40, 0x48, 0x50, 0x57]]  # fmt: skip
        values = np.abs(fp8.E4M3_VALUES[band])
        want = int(np.count_nonzero(values * np.float64(HUGE) > np.finfo(np.float32).max))
        assert 0 < want < 16
    return fp8.Fp8Values(q, s, COLS, BLOCK), want


@pytest.mark.parametrize(
    "case", ["finite", "nan codes", "nan scale", "inf scale", "-inf scale", "overflow"]
)
def test_block_fp8_counts_as_decoded(case):
    form, want = _fp8_case(case)
    decoded = form.values()
    assert stored_nonfinite.count(form) == _count_decoded(decoded.view(np.uint8), "F32") == want


def test_fbgemm_experts_count_as_decoded():
    """A 3-D expert weight's form: a scale per expert and column (block (rows, 1))."""
    experts, rows, cols = 3, 5, 4
    q = _finite_codes(experts * rows * cols)
    s = np.full(experts * cols, 0.01, np.float32)
    s[5] = np.inf  # expert 1, column 1: its 5 values
    q[[0, 33]] = [0xFF, 0x7F]  # two NaN codes, the second in that column (counted once)
    assert 33 // cols % rows and 33 // (rows * cols) == 1 and 33 % cols == 1
    form = fp8.Fp8Values(q, s, cols, (rows, 1))
    assert stored_nonfinite.count(form) == _count_decoded(form.values().view(np.uint8), "F32")
    assert stored_nonfinite.count(form) == 1 + rows


# ---- compressed-tensors FP8: float32(e4m3) * s rounded to the scale's dtype ---------------


def _rounded_fp8(scales: np.ndarray, q: np.ndarray, rows: int, cols: int) -> int:
    form = quantized.fp8_values(q, scales, rows, cols, "BF16")
    per = scales.reshape(-1, 1) if scales.size == rows else scales.reshape(1, 1)
    block = (1, cols) if scales.size == rows else (rows, cols)
    values = fp8.dequantize(q, per.reshape(-1), cols, block, np.empty(rows * cols, np.float32))
    decoded = _count_decoded(int_packed.in_dtype(values, "BF16"), "BF16")
    got = stored_nonfinite.count(form)
    assert got == decoded
    return got


def test_rounded_fp8_counts_as_decoded():
    rows, cols = 4, 8
    q = _finite_codes(rows * cols)
    bf16 = np.array([0.01, 0.02, 0.5, 3.0], np.float32)  # bf16 values
    assert _rounded_fp8(bf16, q, rows, cols) == 0
    nan = q.copy()
    nan[[1, 30]] = 0xFF
    assert _rounded_fp8(bf16, nan, rows, cols) == 2
    bad = bf16.copy()
    bad[2] = np.nan
    assert _rounded_fp8(bad, q, rows, cols) == cols
    # the tie: 448 * 1.140625 * 2**119 is (2 - 2**-8) * 2**127, finite in float32, which
    # rounds to nearest even to bf16's infinity
    tie = np.float32(1.140625 * 2.0**119)
    top = np.full(rows * cols, 0x7E, np.uint8)  # 448
    top[::2] = 0x76  # 256
    assert np.isfinite(np.float32(448) * tie)
    assert _rounded_fp8(np.full(rows, tie, np.float32), top, rows, cols) == rows * cols // 2
    assert _rounded_fp8(np.array([tie], np.float32), top, rows, cols) == rows * cols // 2


# ---- MXFP4: e2m1 * 2**(e8m0 - 127) -------------------------------------------------------


def _mxfp4(scale_bytes: np.ndarray, blocks: np.ndarray, rows: int, groups: int) -> int:
    form = quantized.mxfp4_values(blocks, scale_bytes, rows, groups)
    out = np.empty(scale_bytes.size * mxfp4.GROUP, np.uint16)
    decoded = mxfp4.decode_bf16(blocks, scale_bytes, rows, groups, out)
    got = stored_nonfinite.count(form)
    assert got == _count_decoded(decoded.view(np.uint8), "BF16")
    return got


def test_mxfp4_counts_as_decoded():
    experts, rows, groups = 2, 3, 2
    n = experts * rows * groups
    blocks = _rng().integers(0, 256, n * 16).astype(np.uint8)
    scales = _rng().integers(100, 140, n).astype(np.uint8)
    assert _mxfp4(scales, blocks, rows, groups) == 0
    nan = scales.copy()
    nan[3] = 255  # e8m0's NaN: all 32 values, zero codes too
    assert _mxfp4(nan, blocks, rows, groups) == 32
    # the top exponents: 2**127 * |e2m1| overflows from 2, 2**126 * |e2m1| from 4
    top = scales.copy()
    top[[0, 5]] = [254, 253]
    codes = np.empty((2, 32), np.uint8)
    codes[:] = np.arange(32) % 16  # every code twice
    blocks_top = blocks.reshape(n, 16).copy()
    for k, g in enumerate((0, 5)):
        blocks_top[g] = codes[k, 0::2] | (codes[k, 1::2] << 4)
    want = 2 * 8 + 2 * 4  # |e2m1| in {2, 3, 4, 6} at 254; {4, 6} at 253; both signs
    assert _mxfp4(top, blocks_top.reshape(-1), rows, groups) == want


# ---- packed INT: float32(q - zero) * s rounded to the scale's dtype ----------------------


def _int(bits: int, scales: np.ndarray, zeros: np.ndarray | None, dtype: str) -> int:
    rows, cols = scales.shape[0] if scales.shape[0] > 1 else 4, 16
    codes = _rng().integers(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols))
    codes[0, :2] = [-(1 << (bits - 1)), (1 << (bits - 1)) - 1]
    stored = (codes + (1 << (bits - 1))).astype(np.uint32)
    per = 32 // bits
    words = np.zeros((rows, -(-cols // per)), np.uint32)
    for c in range(cols):
        words[:, c // per] |= stored[:, c] << np.uint32((c % per) * bits)
    raw = words.view(np.uint8).reshape(-1)
    form = quantized.int_values(raw, bits, rows, cols, scales, zeros, dtype)
    floats = np.empty(rows * cols, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # the decoder's non-finite products
        decoded = int_packed.decode_in(raw, bits, rows, cols, scales, zeros, dtype, floats)
    got = stored_nonfinite.count(form)
    assert got == _count_decoded(decoded, dtype)
    return got


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_packed_int_counts_as_decoded(bits, dtype):
    rows, groups = 4, 2
    scales = np.full((rows, groups), 0.01, np.float32)
    zeros = np.ones((rows, groups), np.int16)
    assert _int(bits, scales, zeros, dtype) == 0
    assert _int(bits, scales, None, dtype) == 0
    bad = scales.copy()
    bad[1, 1] = np.nan
    assert _int(bits, bad, zeros, dtype) == 8  # its group of 8 values
    bad[1, 1] = np.inf  # a code equal to its zero point gives NaN, the rest inf
    assert _int(bits, bad, zeros, dtype) == 8
    big = scales.copy()
    big[0, 0] = {"F16": 60000.0, "BF16": 1e38, "F32": 1e38}[dtype]
    # row 0 starts with the lowest and highest codes: their products overflow
    assert _int(bits, big, None, dtype) >= 1
    assert _int(bits, np.array([[big[0, 0]]], np.float32), None, dtype) >= 1


def test_a_form_it_does_not_know_is_left_to_decoding():
    assert stored_nonfinite.count(np.zeros(4, np.uint16)) is None
