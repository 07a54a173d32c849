"""`kernels.mxfp4.decode` against `transformers`' `convert_moe_packed_tensors` (the values a
trainer loads gpt-oss with; dtype float32) bit for bit: random blocks and scales, every code
at the scale extremes (code 8 is -0.0, scale byte 0 gives float32 subnormals), and where
the two differ on purpose: a product that overflows float32 (inf there, NaN here) and a scale
byte of 255 (e8m0's NaN: NaN here for every code). Decoding whole experts in any grouping
gives the same values. `decode_bf16` (the numba kernel, and its numpy fallback) gives those
values' bfloat16 bits, which are transformers' bf16 ones, and bfloat16's quiet NaN where
they are NaN, for row counts around the kernel's tile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mxfp4_models import decode as spec_decode
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from ram_dist.kernels import mxfp4


def _decode(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """ram-dist's values of whole experts, [E, G*32, R], through a longer `out` (the rest of
    which must stay as it was)."""
    e, r, g, _ = blocks.shape
    n = e * g * 32 * r
    out = np.full(n + 7, 12345.0, np.float32)
    got = mxfp4.decode(blocks.numpy().reshape(-1), scales.numpy().reshape(-1), r, g, out)
    assert got.dtype == np.float32 and got.size == n
    assert np.shares_memory(got, out) and (out[n:] == 12345.0).all()
    assert mxfp4.decoded_shape(tuple(blocks.shape)) == (e, g * 32, r)
    return got.reshape(e, g * 32, r).copy()


def _transformers(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def _random(e: int, r: int, g: int, low: int, high: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, r, g, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high + 1, (e, r, g), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_e2m1_table_is_transformers_and_the_specs():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert _bits(mxfp4.E2M1).tolist() == _bits(np.array(FP4_VALUES, np.float32)).tolist()
    assert np.signbit(mxfp4.E2M1[8]) and mxfp4.E2M1[8] == 0 and not np.signbit(mxfp4.E2M1[0])


@pytest.mark.parametrize(
    "shape, low, high",
    [
        ((4, 64, 2, 16), 100, 140),  # gpt-oss's range of scales
        ((3, 5, 3, 16), 0, 254),  # every scale byte but e8m0's NaN
        ((1, 1, 1, 16), 127, 127),
        ((2, 7, 1, 16), 0, 10),  # float32 subnormals
    ],
)
def test_random_blocks_decode_as_transformers(shape, low, high):
    blocks, scales = _random(*shape[:3], low, high, seed=sum(shape) + low)
    if high == 254:  # both ends of the range for sure
        scales.view(-1)[:4] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)
        blocks.view(-1)[16 * 3 : 16 * 4] = 0x77  # 6 * 2**127 at scale 254: overflows
    got, want = _decode(blocks, scales), _transformers(blocks, scales)
    finite = np.isfinite(want)
    assert np.array_equal(_bits(got[finite]), _bits(want[finite]))
    # the spec's formula (tests/support), bit for bit everywhere, NaN where it overflows
    spec = spec_decode(blocks, scales).numpy()
    assert np.array_equal(_bits(got[finite]), _bits(spec[finite]))
    # where transformers overflows to +-inf this is NaN (refused by the NaN/Inf check)
    assert np.isnan(got[~finite]).all() and np.isinf(want[~finite]).all()
    if high == 254:
        assert (~finite).any()  # the overflow seen at least once
    else:
        assert finite.all()


def _every_code(scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert, one row, one group: the 16 codes (low nibbles) then again (high
    nibbles), in order."""
    codes = torch.arange(16, dtype=torch.uint8)
    low = codes[0::2] | (codes[1::2] << 4)
    blocks = torch.cat([low, low]).reshape(1, 1, 1, 16)
    return blocks, torch.full((1, 1, 1), scale, dtype=torch.uint8)


@pytest.mark.parametrize("scale", [0, 1, 2, 126, 127, 128, 200, 252])
def test_every_code_at_a_finite_scale(scale):
    blocks, scales = _every_code(scale)
    got, want = _decode(blocks, scales).reshape(-1), _transformers(blocks, scales).reshape(-1)
    assert np.array_equal(_bits(got), _bits(want))
    exact = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64) * 2.0 ** (scale - 127)
    exact = np.concatenate([exact, -exact]).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(np.concatenate([exact, exact])))
    assert np.signbit(got[8]) and got[8] == 0  # code 8: -0.0
    if scale == 0:  # 0.5 * 2**-127 = 2**-128: a float32 subnormal, kept exactly
        assert got[1] == np.float32(2.0**-128) and got[1] < np.finfo(np.float32).tiny


@pytest.mark.parametrize("scale, largest", [(253, 3.0), (254, 1.5)])
def test_large_scales_overflow_to_nan_where_transformers_gives_inf(scale, largest):
    """2**128 and more is past float32's largest: at scale 253 (2**126) codes 4 and 6, at
    254 (2**127) codes 2 and more."""
    blocks, scales = _every_code(scale)
    got, want = _decode(blocks, scales).reshape(-1), _transformers(blocks, scales).reshape(-1)
    magnitudes = np.tile(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]), 4)
    overflow = magnitudes > largest
    assert np.array_equal(_bits(got[~overflow]), _bits(want[~overflow]))
    top = int(np.flatnonzero(magnitudes == largest)[0])
    assert got[top] == np.float32(largest * 2.0 ** (scale - 127))  # the largest finite one
    assert np.isinf(want[overflow]).all() and np.isnan(got[overflow]).all()
    signs = np.tile(np.repeat([1.0, -1.0], 8), 2)  # codes 0-7 positive, 8-15 negative
    assert np.array_equal(np.sign(want[overflow]), signs[overflow])


def test_a_scale_byte_of_255_is_nan_for_every_code():
    """e8m0's NaN: NaN here for every code, zeros included. transformers reads it as 2**128:
    zeros stay zeros, code 1 gives 2**127 (finite), the rest +-inf."""
    blocks, _ = _every_code(127)
    scales = torch.full((1, 1, 1), 255, dtype=torch.uint8)
    assert np.isnan(_decode(blocks, scales)).all()
    want = _transformers(blocks, scales).reshape(-1)[:16]
    assert want[0] == 0 and want[8] == 0 and np.signbit(want[8])
    assert want[1] == np.float32(2.0**127) and want[9] == -np.float32(2.0**127)
    assert np.isinf(np.delete(want, [0, 1, 8, 9])).all()


def test_nan_scale_in_one_group_only_touches_that_group():
    blocks, scales = _random(2, 3, 2, 120, 130, seed=5)
    scales[1, 2, 0] = 255
    got, want = _decode(blocks, scales), _transformers(blocks, scales)
    nan = np.zeros(got.shape, bool)
    nan[1, 0:32, 2] = True  # expert 1, row 2, group 0: values [1, c, 2] for c < 32
    assert np.isnan(got[nan]).all() and not np.isnan(got[~nan]).any()
    assert np.array_equal(_bits(got[~nan]), _bits(want[~nan]))


@pytest.mark.parametrize("groups", [[1, 1, 1, 1, 1], [2, 3], [5], [1, 4], [3, 1, 1]])
def test_whole_experts_in_any_grouping_give_the_same_values(groups):
    blocks, scales = _random(5, 6, 3, 90, 160, seed=11)
    whole = _decode(blocks, scales)
    parts, start = [], 0
    for n in groups:
        parts.append(_decode(blocks[start : start + n], scales[start : start + n]))
        start += n
    assert np.array_equal(_bits(np.concatenate(parts)), _bits(whole))
    assert np.array_equal(_bits(whole), _bits(_transformers(blocks, scales)))


# ---- decode_bf16: the values as bfloat16 bits (numba, and numpy where numba is missing) ----


@pytest.fixture(params=["numba", "numpy"])
def bf16_path(request, monkeypatch) -> str:
    """`decode_bf16` by the numba kernel, or by its numpy fallback (numba taken away)."""
    from ram_dist import kernels

    if request.param == "numba" and not kernels.available():
        pytest.skip("numba is not installed")
    if request.param == "numpy":
        monkeypatch.setitem(kernels._MODULES, "mxfp4_numba", None)
    return request.param


def _decode_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """ram-dist's bfloat16 bits of whole experts, [E, G*32, R], through a longer `out`."""
    e, r, g, _ = blocks.shape
    n = e * g * 32 * r
    out = np.full(n + 5, 0xABCD, np.uint16)
    got = mxfp4.decode_bf16(blocks.numpy().reshape(-1), scales.numpy().reshape(-1), r, g, out)
    assert got.dtype == np.uint16 and got.size == n
    assert np.shares_memory(got, out) and (out[n:] == 0xABCD).all()
    return got.reshape(e, g * 32, r).copy()


def _transformers_bf16(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize(
    "shape",
    [(4, 64, 2, 16), (2, 65, 3, 16), (3, 130, 1, 16), (1, 5, 2, 16), (5, 1, 1, 16)],
    ids=["tile", "tile+1", "two-tiles+2", "short", "one-row"],
)
def test_bf16_bits_are_transformers_bf16_and_the_float32_values_top_half(bf16_path, shape):
    """Rows around the numba kernel's tile of 64; every scale byte (0, 254 and 255 for sure):
    where the float32 value is finite its top half, which is transformers' bf16 value;
    bfloat16's quiet NaN 0x7FC0 where it is NaN (a scale byte of 255, an overflow)."""
    blocks, scales = _random(*shape[:3], 0, 255, seed=sum(shape))
    scales.view(-1)[:3] = torch.tensor([0, 254, 255], dtype=torch.uint8)[: scales.numel()]
    got = _decode_bf16(blocks, scales)
    f32 = _decode(blocks, scales)
    finite = np.isfinite(f32)
    assert np.array_equal(got[finite], (_bits(f32[finite]) >> 16).astype(np.uint16))
    assert (got[~finite] == 0x7FC0).all()
    want = _transformers_bf16(blocks, scales).numpy().view(np.uint16)
    assert np.array_equal(got[finite], want[finite])


@pytest.mark.parametrize("scale", [0, 1, 126, 127, 128, 252])
def test_bf16_bits_of_every_code(bf16_path, scale):
    blocks, scales = _every_code(scale)
    got = _decode_bf16(blocks, scales).reshape(-1)
    want = _transformers_bf16(blocks, scales).numpy().view(np.uint16).reshape(-1)
    assert np.array_equal(got, want)
    assert got[8] == 0x8000 and got[24] == 0x8000  # code 8: -0.0


@pytest.mark.parametrize("scale", [253, 254, 255])
def test_bf16_bits_are_nan_where_the_values_are(bf16_path, scale):
    blocks, scales = _every_code(scale)
    got = _decode_bf16(blocks, scales).reshape(-1)
    nan = np.isnan(_decode(blocks, scales).reshape(-1))
    assert nan.any() and (got[nan] == 0x7FC0).all()
    finite = _transformers_bf16(blocks, scales).numpy().view(np.uint16).reshape(-1)
    assert np.array_equal(got[~nan], finite[~nan])


@pytest.mark.parametrize("groups", [[1, 1, 1, 1, 1], [2, 3], [5], [3, 1, 1]])
def test_bf16_bits_of_whole_experts_in_any_grouping(bf16_path, groups):
    blocks, scales = _random(5, 70, 2, 90, 160, seed=13)
    whole = _decode_bf16(blocks, scales)
    parts, start = [], 0
    for n in groups:
        parts.append(_decode_bf16(blocks[start : start + n], scales[start : start + n]))
        start += n
    assert np.array_equal(np.concatenate(parts), whole)
