"""compressed-tensors' packed INT4/INT8 decoding (`kernels.int_packed`): the numba kernel and
the numpy rule give compressed-tensors' own `decompress` bytes, for 4 and 8 bits, group,
channel and tensor scales in bf16 and fp16, with and without zero points (packed along
dimension 0), rows cut anywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ram_dist.kernels import int_packed

pytestmark = pytest.mark.quick

ROWS, COLS = 24, 64


def _packed(bits: int, groups: int, zero: bool, dtype: torch.dtype, seed: int):
    """(words [ROWS, P] int32, scales, zeros packed or None, decompressed values)."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (ROWS, COLS), generator=g, dtype=torch.int8)
    shape = (ROWS, groups) if groups else (1, 1)
    scales = (torch.rand(shape, generator=g) * 0.01 + 1e-4).to(dtype)
    zeros = torch.randint(lo, hi, shape, generator=g, dtype=torch.int8) if zero else None
    words = pack_to_int32(q, bits)
    # compressed-tensors' own dequantize: in the scale's dtype
    z = torch.zeros(shape, dtype=torch.int8) if zeros is None else zeros
    size = COLS // (groups or 1)
    sv = scales.repeat_interleave(size, 1) if groups else scales.expand(ROWS, COLS)
    zv = z.repeat_interleave(size, 1) if groups else z.expand(ROWS, COLS)
    back = unpack_from_int32(words, bits, torch.Size((ROWS, COLS)))
    assert torch.equal(back, q)
    want = (back.to(dtype) - zv.to(dtype)) * sv
    packed_zeros = pack_to_int32(zeros, bits, packed_dim=0) if zero and groups else zeros
    return words, scales, packed_zeros, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("zero", [False, True], ids=["symmetric", "zero-point"])
@pytest.mark.parametrize("bits, groups", [(4, 2), (4, 1), (8, 4), (8, 0), (4, 0)])
def test_the_kernel_and_numpy_give_compressed_tensors_values(bits, groups, zero, dtype):
    words, scales, zeros, want = _packed(bits, groups, zero, dtype, seed=bits + groups)
    name = "BF16" if dtype == torch.bfloat16 else "F16"
    raw = words.numpy().view(np.uint8)
    per_row = raw.size // ROWS
    for first, last in ((0, ROWS), (3, 11), (8, 24)):  # rows cut anywhere
        rows = last - first
        words_at = raw.reshape(ROWS, per_row)[first:last].reshape(-1)
        s = scales.float().numpy()
        s = s[first:last] if groups else s
        z = None
        if zeros is not None and groups:
            column = int_packed.unpack_columns(
                zeros.numpy().view(np.uint8).reshape(-1), bits, groups
            )
            z = column[first:last]
        elif zeros is not None:
            z = zeros.numpy().astype(np.int16).reshape(1, 1)
        got = int_packed.decode_in(
            words_at, bits, rows, COLS, s, z, name, np.empty(rows * COLS, np.float32)
        )
        codes = int_packed.unpack_rows(words_at, bits, rows, COLS)
        numpy = int_packed.in_dtype(
            int_packed.decode(codes, z, s, np.empty(rows * COLS, np.float32)), name
        )
        expected = want[first:last].contiguous().view(torch.int16).numpy().view(np.uint8)
        assert np.array_equal(numpy.reshape(-1), expected.reshape(-1))
        assert np.array_equal(got.reshape(-1), expected.reshape(-1))
