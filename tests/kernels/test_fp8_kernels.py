"""The FP8 rounding primitives: e4m3fn values, the nearest-even saturating encoding, scale
storage, and the numba kernels against the numpy rule (bit for bit), with torch as the
independent oracle of the e4m3fn cast (after a clamp to +-448, the spec's saturation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ram_dist import kernels
from ram_dist.kernels import fp8

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _edge_values() -> np.ndarray:
    """Every e4m3fn value, every midpoint between neighbours and the floats next to them,
    the saturation boundary, infinities, NaN, signed zeros, float32 subnormals."""
    finite = np.unique(fp8.E4M3_VALUES[~np.isnan(fp8.E4M3_VALUES)].astype(np.float64))
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    special = np.array(
        [np.inf, -np.inf, np.nan, 448, 460, 464, 465, 1e6, -0.0, 0.0, 1e-45, -1e-40, 2**-10],
        dtype=np.float32,
    )
    rng = np.random.default_rng(0)
    noise = np.concatenate([rng.standard_normal(20000).astype(np.float32) * m
                            for m in (1e-3, 1.0, 300.0)])  # fmt: skip
    return np.concatenate([finite.astype(np.float32), mids, up, down, special, noise])


def test_e4m3_values_are_torchs():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(codes)
    assert np.array_equal(nan, np.isnan(fp8.E4M3_VALUES)) and nan.sum() == 2
    assert np.array_equal(codes[~nan].view(np.uint32), fp8.E4M3_VALUES[~nan].view(np.uint32))


def test_encoding_is_nearest_even_saturated():
    v = _edge_values()
    want = torch.from_numpy(v).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    got = fp8.to_e4m3(v)
    finite = ~np.isnan(v)
    assert np.array_equal(got[finite], want.numpy()[finite])
    assert set(got[~finite] & 0x7F) == {0x7F}  # NaN stays NaN


def test_bf16_scales_round_to_nearest_even():
    v = _edge_values()
    v = v[np.isfinite(v)]
    want = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    assert np.array_equal(fp8.scale_bytes(v, "BF16"), want)
    back = fp8.scale_values(fp8.scale_bytes(v, "BF16"), "BF16")
    assert np.array_equal(back, torch.from_numpy(v).to(torch.bfloat16).float().numpy())


@pytest.mark.skipif(not kernels.available(), reason="numba is not installed")
@pytest.mark.parametrize("scale_dtype", ["F32", "BF16"])
@pytest.mark.parametrize(
    "rows, cols, block", [(70, 45, (16, 8)), (5, 7, (16, 8)), (300, 260, (128, 128))]
)
def test_numba_kernels_give_the_numpy_bytes(rows, cols, block, scale_dtype):
    rng = np.random.default_rng(rows)
    n = rows * cols
    bands, blocks = -(-rows // block[0]), -(-cols // block[1])
    q = rng.integers(0, 256, n, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x80  # no NaN in the base: -0 instead
    scales = fp8.scale_bytes(rng.random(bands * blocks).astype(np.float32) * 1e-2, scale_dtype)
    values = fp8.scale_values(scales, scale_dtype)
    x = [fp8.dequantize(q, values, cols, block, np.empty(n, np.float32), fast=f)
         for f in (True, False)]  # fmt: skip
    assert np.array_equal(x[0].view(np.uint32), x[1].view(np.uint32))
    base_x = x[0]
    y = base_x.copy().reshape(rows, cols)
    y[block[0] :, : block[1]] *= np.float32(1.5)  # changed blocks, others left as they were
    y[0, -1] = np.float32(1e-9)
    edges = _edge_values()
    y[-1, : min(cols, 40)] = edges[rng.integers(0, edges.size, min(cols, 40))]
    y = y.reshape(-1)
    out = [np.empty(n, np.uint8) for _ in range(2)]
    stored = [fp8.requantize(y, base_x, q, scales, cols, block, scale_dtype, o, fast=f)
              for o, f in zip(out, (True, False), strict=True)]  # fmt: skip
    assert np.array_equal(stored[0], stored[1]) and np.array_equal(out[0], out[1])
    if rows <= block[0] or cols <= block[1]:
        return  # a single block, changed
    # A block left as it was keeps the base's scale and bytes.
    itemsize = 4 if scale_dtype == "F32" else 2
    assert np.array_equal(stored[0][:itemsize], scales[:itemsize])
    assert np.array_equal(out[0].reshape(rows, cols)[0, :-block[1]],
                          q.reshape(rows, cols)[0, :-block[1]])  # fmt: skip


@pytest.mark.skipif(not kernels.available(), reason="numba is not installed")
def test_encode_rounds_exact_quotients_at_ties():
    """A block whose amax is 448 has scale 1: its quotients are the values themselves, so
    ties between e4m3fn neighbours reach the encoder exactly."""
    finite = np.unique(fp8.E4M3_VALUES[~np.isnan(fp8.E4M3_VALUES)].astype(np.float64))
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    y = np.zeros((16, 8 * 64), dtype=np.float32).reshape(-1)
    y[: mids.size] = mids
    y[mids.size] = 448.0
    cols, block = 8 * 64, (16, 8 * 64)
    base_q = np.zeros(y.size, np.uint8)
    base_x = np.ones(y.size, np.float32)
    outs = []
    for fast in (True, False):
        out = np.empty(y.size, np.uint8)
        stored = fp8.requantize(y, base_x, base_q, np.ones(1, np.float32).view(np.uint8),
                                cols, block, "F32", out, fast=fast)  # fmt: skip
        assert stored.view(np.float32)[0] == 1.0
        outs.append(out)
    want = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(outs[0], want) and np.array_equal(outs[1], want)


@pytest.mark.parametrize(
    "rows, cols, block, scale_dtype, rounded_to",
    [
        (70, 45, (16, 8), "F32", ""),  # block FP8, ragged
        (600, 600, (128, 128), "BF16", ""),  # several band groups (BAND_GROUP / band)
        (900, 300, (1, 300), "BF16", "BF16"),  # compressed-tensors per channel, bf16 values
        (40, 30, (40, 30), "F32", ""),  # per tensor
        (3 * 20, 16, (20, 1), "F32", ""),  # fbgemm's experts: an expert's column a group
    ],
)
def test_requantize_stored_is_requantize_of_the_base_values(
    rows, cols, block, scale_dtype, rounded_to, monkeypatch
):
    """The base's values made from its stored bytes a few bands at a time give the bytes
    `requantize` gives with the base's values (rounded to bf16 where they are), unchanged
    groups keeping the base's bytes and scale even where a fresh scale would differ."""
    monkeypatch.setattr(fp8, "BAND_GROUP", 5000)  # several groups of bands on small tensors
    rng = np.random.default_rng(cols)
    n = rows * cols
    bands, blocks = -(-rows // block[0]), -(-cols // block[1])
    q = rng.integers(0, 256, n, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x80
    # scales far from amax / 448: a group requantized afresh would not keep the base's
    scales = fp8.scale_bytes(rng.random(bands * blocks).astype(np.float32) * 1e-2, scale_dtype)
    values = fp8.dequantize(q, fp8.scale_values(scales, scale_dtype), cols, block,
                            np.empty(n, np.float32))  # fmt: skip
    if rounded_to:
        values = fp8.scale_values(fp8.scale_bytes(values, rounded_to), rounded_to)
    y = values.copy().reshape(rows, cols)
    y[block[0] :, : block[1]] *= np.float32(1.5)
    y = y.reshape(-1)
    want_q, got_q = np.empty(n, np.uint8), np.empty(n, np.uint8)
    want = fp8.requantize(y, values, q, scales, cols, block, scale_dtype, want_q)
    scratch = np.empty(max(5000, block[0] * cols), np.float32)
    got = fp8.requantize_stored(y, q, scales, cols, block, scale_dtype, rounded_to, got_q,
                                scratch)  # fmt: skip
    assert np.array_equal(got, want) and np.array_equal(got_q, want_q)
    same = got_q.reshape(rows, cols)[: block[0]] == q.reshape(rows, cols)[: block[0]]
    first = blocks * (4 if scale_dtype == "F32" else 2)  # the first band's scale bytes
    assert bool(same.all()) and np.array_equal(got[:first], scales[:first])  # kept
    assert np.array_equal(
        fp8.requantize_stored(y, q, scales, cols, block, scale_dtype, rounded_to, None, scratch),
        want,
    )
