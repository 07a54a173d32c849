"""MXFP4 and packed INT4/INT8 inputs decoded by the fused kernels as they load them
(`kernels.quantized`, `primitives.load_span`): each span's float32 bits are those of
`mxfp4.decode_bf16`'s and `int_packed.decode_in`'s values, widened, for every INT scheme
(4 and 8 bits; group, channel and tensor scales; with and without zero points; bf16, f16 and
f32 scales) and every MXFP4 code and scale (0, 254, 255), for spans that start mid-row and
mid-group and cross rows; and the RAM kernels and the precision check give, on the stored
form, what they give on the decoded values."""

from __future__ import annotations

import numpy as np
import pytest

from ram_dist.kernels import int_packed, mxfp4, quantized
from ram_dist.planning.sources import Fp8Source

numba = pytest.importorskip("numba")

from ram_dist.kernels import precision_numba, ram_numba, views  # noqa: E402
from ram_dist.kernels.primitives import load_span  # noqa: E402


@numba.njit
def _span(src, lo, m, dst):  # noqa: ANN001, ANN202  (numba arrays)
    load_span(src, lo, m, dst)


def _widened(raw16: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 bits of 16-bit values' bytes (bf16: shifted; f16: numpy's exact widening,
    every value here finite) or float32 bytes as they are."""
    if dtype == "BF16":
        return raw16.view(np.uint16).astype(np.uint32) << np.uint32(16)
    if dtype == "F16":
        return raw16.view(np.float16).astype(np.float32).view(np.uint32)
    return raw16.view(np.uint32)


def _spans(size: int, period: int) -> list[tuple[int, int]]:
    """Spans from the start, mid-row and mid-group (`period` apart) and crossing rows."""
    odd = [(0, size), (1, 7), (period - 3, 9), (period + 5, 2 * period + 1), (3, size - 3)]
    return [(lo, m) for lo, m in odd if 0 <= lo and m > 0 and lo + m <= size]


def _assert_spans(values: quantized.QuantizedValues, want: np.ndarray, period: int) -> None:
    src = views.kernel_record(values, False)
    for lo, m in _spans(values.size, period):
        dst = np.full(m + 4, 0xDEADBEEF, np.uint32)
        _span(src, lo, m, dst)
        np.testing.assert_array_equal(dst[:m], want[lo : lo + m], err_msg=f"span {lo}+{m}")
        assert (dst[m:] == 0xDEADBEEF).all()


# ---- packed INT ------------------------------------------------------------------------

ROWS, COLS = 6, 64


def _int_case(bits: int, groups: int, zero: bool, dtype: str, seed: int):
    """Random packed rows: (words' bytes, scales float32 [rows or 1, G], zeros or None)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (ROWS, COLS), dtype=np.uint32)
    words = np.zeros((ROWS, int_packed.words_per_row(COLS, bits)), np.uint32)
    for c in range(COLS):
        words[:, c * bits // 32] |= codes[:, c] << np.uint32(c * bits % 32)
    shape = (ROWS, groups) if groups else (1, 1)
    scales = (rng.random(shape, np.float32) * 0.02 + 1e-4).astype(np.float32)
    scales *= rng.choice([-1, 1], shape).astype(np.float32)
    if dtype == "BF16":  # a value a bf16 scale holds
        scales = ((scales.view(np.uint32) >> 16) << 16).view(np.float32)
    elif dtype == "F16":
        scales = scales.astype(np.float16).astype(np.float32)
    lo = -(1 << (bits - 1))
    zeros = rng.integers(lo, -lo, shape).astype(np.int16) if zero else None
    return words.view(np.uint8).reshape(-1), scales, zeros


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("zero", [False, True], ids=["symmetric", "zero-point"])
@pytest.mark.parametrize("bits, groups", [(4, 4), (4, 1), (4, 0), (8, 2), (8, 1), (8, 0)])
def test_int_spans_are_decode_in_bit_for_bit(bits, groups, zero, dtype):
    words, scales, zeros = _int_case(bits, groups, zero, dtype, seed=bits * 10 + groups)
    floats = np.empty(ROWS * COLS, np.float32)
    want = int_packed.decode_in(words, bits, ROWS, COLS, scales, zeros, dtype, floats)
    want = _widened(np.array(want), dtype)
    values = quantized.int_values(words, bits, ROWS, COLS, scales, zeros, dtype)
    _assert_spans(values, want, COLS // (groups or 1))


@pytest.mark.quick
def test_int_values_that_round_are_rounded_to_the_scale_dtype():
    """A scale with low bits set, (q - z) * s inexact in bf16: the span rounds as
    `decode_in` does (in f16, into its subnormals and to inf too)."""
    words, _, _ = _int_case(8, 1, False, "F32", seed=3)
    for dtype, s in (("BF16", 1.2345678e-3), ("F16", 3.3e-7), ("F16", 700.123)):
        scales = np.full((ROWS, 1), s, np.float32)
        floats = np.empty(ROWS * COLS, np.float32)
        with np.errstate(over="ignore"):
            want = int_packed.decode_in(words, 8, ROWS, COLS, scales, None, dtype, floats)
        want = np.array(want).view(np.uint16)
        if dtype == "F16":  # widened as the kernels widen a float16 input (inf included)
            want = want.view(np.float16).astype(np.float32).view(np.uint32)
        else:
            want = want.astype(np.uint32) << np.uint32(16)
        values = quantized.int_values(words, 8, ROWS, COLS, scales, None, dtype)
        _assert_spans(values, want, COLS)


# ---- MXFP4 -----------------------------------------------------------------------------


def _mxfp4_case(e: int, r: int, g: int, scales: np.ndarray | None, seed: int):
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, e * r * g * 16, dtype=np.uint8)
    if scales is None:
        scales = rng.integers(110, 140, e * r * g, dtype=np.uint8)
    return blocks, scales


def _mxfp4_want(blocks: np.ndarray, scales: np.ndarray, r: int, g: int) -> np.ndarray:
    out = np.empty(scales.size * mxfp4.GROUP, np.uint16)
    got = mxfp4.decode_bf16(blocks, scales, r, g, out)
    return got.astype(np.uint32) << np.uint32(16)


@pytest.mark.quick
@pytest.mark.parametrize("e, r, g", [(1, 5, 1), (2, 7, 3), (3, 40, 2)])
def test_mxfp4_spans_are_decode_bf16_bit_for_bit(e, r, g):
    blocks, scales = _mxfp4_case(e, r, g, None, seed=e + r + g)
    want = _mxfp4_want(blocks, scales, r, g)
    _assert_spans(quantized.mxfp4_values(blocks, scales, r, g), want, r)


@pytest.mark.quick
@pytest.mark.parametrize("scale", [0, 1, 127, 253, 254, 255])
def test_mxfp4_every_code_at_edge_scales(scale):
    """Every byte (both nibbles: every code, 8 as -0.0) at scale bytes 0 (2**-127, a
    subnormal), 254 (values beyond float32: NaN) and 255 (e8m0's NaN: every value NaN)."""
    r, g = 16, 1  # 16 packed rows of one group: 256 bytes
    blocks = np.arange(256, dtype=np.uint8)
    scales = np.full(r * g, scale, np.uint8)
    want = _mxfp4_want(blocks, scales, r, g)
    if scale == 255:
        assert (want == 0x7FC00000).all()
    _assert_spans(quantized.mxfp4_values(blocks, scales, r, g), want, r)


@pytest.mark.quick
def test_mxfp4_every_code_at_every_scale():
    """Every byte at every scale byte 0..255, 4096 packed rows of one group (16 rows a
    scale, their 256 bytes every byte once), read as rows of 4096 values (the panel's fill
    in scratch tiles, with a partial last tile of a row, `fill_panel`)."""
    r, g = 16 * 256, 1
    blocks = np.tile(np.arange(256, dtype=np.uint8), 256)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 16)
    want = _mxfp4_want(blocks, scales, r, g)
    _assert_spans(quantized.mxfp4_values(blocks, scales, r, g), want, r)
    r = 16 * 255 + 5  # rows not a multiple of the scratch's tile
    blocks, scales = blocks[: r * 16], scales[:r]
    _assert_spans(
        quantized.mxfp4_values(blocks, scales, r, g), _mxfp4_want(blocks, scales, r, g), r
    )


@pytest.mark.quick
def test_mxfp4_a_nan_scale_in_one_block_only():
    blocks, scales = _mxfp4_case(2, 9, 2, None, seed=7)
    scales[5] = 255
    want = _mxfp4_want(blocks, scales, 9, 2)
    assert 0 < (want == 0x7FC00000).sum() < want.size
    _assert_spans(quantized.mxfp4_values(blocks, scales, 9, 2), want, 9)


# ---- FP8 with a 16-bit scale (compressed-tensors' float-quantized) ----------------------


def _fp8_source(dtype: str, rows: int, per_tensor: bool) -> Fp8Source:
    """A compressed-tensors FP8 weight of ROWS x COLS whose values round to `dtype` (its
    scale's), a scale per row or one for the tensor."""
    block = (rows, COLS) if per_tensor else (1, COLS)
    return Fp8Source("w", 0, "F8_E4M3", "s", 0, dtype, block, COLS, rounded_to=dtype)


@pytest.mark.quick
@pytest.mark.parametrize("per_tensor", [False, True], ids=["channel", "tensor"])
def test_rounded_fp8_spans_are_the_sources_decode_bit_for_bit(per_tensor):
    """Every e4m3 byte (NaN codes, subnormals, 448) times bf16 scales whose products round
    (a bf16 scale is the one compressed-tensors' FP8 rounds to): the spans are
    `Fp8Source.decode`'s values, widened, and the source hands the kernels that form (no
    copy of the values)."""
    dtype = "BF16"
    rng = np.random.default_rng(11)
    q = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, ROWS * COLS - 256)])
    q = q.astype(np.uint8)
    n = 1 if per_tensor else ROWS
    scales = np.array([3.1e-3, 1.7e2, 6.1e-5, 0.37, 1.0, 2.9e1][:n], np.float32)
    raw = int_packed.in_dtype(scales, dtype)  # the scales as stored
    src = _fp8_source(dtype, ROWS, per_tensor)
    read = [q, raw]
    decoded = src.decode(0, q.size, read, lambda k: np.empty(k, np.float32), None)
    want = _widened(decoded, dtype)
    values = src.encoded(0, q.size, read)
    assert isinstance(values, quantized.QuantizedValues) and values.format == quantized.FP8
    _assert_spans(values, want, COLS)


# ---- the kernels on the stored form ----------------------------------------------------


def _bf16_tasks(want: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    """bf16 tasks near the base (bits): some elements moved, most left alone."""
    rng = np.random.default_rng(seed)
    base = (want >> np.uint32(16)).astype(np.uint16)
    tasks = []
    for _ in range(n):
        t = base.copy()
        moved = rng.random(t.size) < 0.3
        t[moved] = (t[moved].astype(np.int32) + rng.integers(-40, 40, moved.sum())).astype(
            np.uint16
        )
        tasks.append(t)
    return tasks


def _cases():
    """(id, stored form, decoded values' bytes, their dtype)."""
    blocks, scales = _mxfp4_case(2, 33, 3, None, seed=11)
    out = np.empty(scales.size * mxfp4.GROUP, np.uint16)
    raw = mxfp4.decode_bf16(blocks, scales, 33, 3, out).view(np.uint8)
    yield "mxfp4", quantized.mxfp4_values(blocks, scales, 33, 3), raw, "BF16"
    for dtype in ("BF16", "F16", "F32"):
        words, s, z = _int_case(4, 4, True, dtype, seed=5)
        floats = np.empty(ROWS * COLS, np.float32)
        raw = np.array(int_packed.decode_in(words, 4, ROWS, COLS, s, z, dtype, floats))
        values = quantized.int_values(words, 4, ROWS, COLS, s, z, dtype)
        yield f"int4-{dtype}", values, raw, dtype


#: The array the engine hands the kernels for decoded values' bytes, by dtype.
_VIEWS = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_the_ram_kernels_give_the_decoded_inputs_results(case):
    """Counts, NaN/Inf counts, the precision check and the merge into bf16 and float32, with
    the quantized input as base and as a task: the same as on its decoded values."""
    _, values, raw, dtype = case
    decoded = raw.view(_VIEWS[dtype])
    tasks = _bf16_tasks(_widened(raw, dtype), 3, seed=1)
    for base, others in ((values, tasks), (tasks[0], [values, *tasks[1:]])):
        plain_base = decoded if base is values else base
        plain = [decoded if t is values else t for t in others]
        got = ram_numba.overlap_counts_checked(base, others, 1e-5)
        ref = ram_numba.overlap_counts_checked(plain_base, plain, 1e-5)
        np.testing.assert_array_equal(got[0], ref[0])
        assert got[1] == ref[1]
        np.testing.assert_array_equal(got[2], ref[2])
        checks = precision_numba.check_counts([base, *others], 1e-5)
        np.testing.assert_array_equal(
            checks, precision_numba.check_counts([plain_base, *plain], 1e-5)
        )
        for out_dtype in (np.uint16, np.float32):
            out = np.empty(values.size, out_dtype)
            ref_out = np.empty(values.size, out_dtype)
            ram_numba.merge_ram(base, others, 1e-5, [0.5, 1.0, 1.5], out, bf16_nan=0x7FC0)
            ram_numba.merge_ram(plain_base, plain, 1e-5, [0.5, 1.0, 1.5], ref_out, bf16_nan=0x7FC0)
            np.testing.assert_array_equal(out.view(np.uint8), ref_out.view(np.uint8))
