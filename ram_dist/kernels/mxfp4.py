"""MXFP4 weights as gpt-oss ships them, decoded exactly into float32 (numpy).

A weight `N` is stored as `N_blocks` (uint8, [E, R, G, 16]: two e2m1 codes a byte, low
nibble first) and `N_scales` (uint8, [E, R, G]: an e8m0 exponent per 32 codes). Its value is
the tensor of shape [E, G*32, R] that `transformers`' `convert_moe_packed_tensors` returns
(the unpacked [E, R, G*32] with axes 1 and 2 swapped: the name and layout of a bf16 gpt-oss
checkpoint and of its agents):

    N[e, c, r] = e2m1(code) * 2**(scales[e, r, c // 32] - 127)

where `code` is the low nibble of `blocks[e, r, c // 32, (c % 32) // 2]` for an even `c`,
the high nibble for an odd one, and `e2m1` the table `E2M1` (bit 3 the sign: code 8 is
-0.0). Every product is exact in float32 (the smallest, 0.5 * 2**-127, is a float32
subnormal) but where it overflows float32 (2 * 2**127 and more): that value, and every value
of a scale byte of 255 (e8m0's NaN), is NaN here, which the first reduce round's NaN/Inf
check refuses, naming the tensor.
"""

from __future__ import annotations

import numpy as np

#: e2m1's sixteen values by code (bit 3 the sign: code 8 is -0.0), as `transformers` has them.
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
#: e8m0's bias, and its one NaN.
BIAS, NAN_SCALE = 127, 255
#: Codes per scale, and per byte.
GROUP = 32


def decode_bf16(
    blocks: np.ndarray, scales: np.ndarray, rows: int, groups: int, out: np.ndarray
) -> np.ndarray:
    """`decode`'s values as bfloat16 bits (uint16, into `out`): every value is exact in
    bfloat16 (an e2m1 code times a power of two), a NaN bfloat16's quiet NaN. By the numba
    kernel (`mxfp4_numba`) where numba is installed, else from `decode`'s float32 values."""
    from ram_dist.kernels import numba_module

    kernel = numba_module("mxfp4_numba")
    if kernel is not None:
        return kernel.decode_bf16(blocks, scales, rows, groups, out)
    values = decode(blocks, scales, rows, groups, np.empty(scales.size * GROUP, np.float32))
    top = (values.view(np.uint32) >> 16).astype(np.uint16)
    top[np.isnan(values)] = 0x7FC0
    n = top.size
    out[:n] = top
    return out[:n]


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """[E, G*32, R] from the blocks' [E, R, G, 16]."""
    e, r, g, _ = blocks_shape
    return (e, g * GROUP, r)


def decode(
    blocks: np.ndarray, scales: np.ndarray, rows: int, groups: int, out: np.ndarray
) -> np.ndarray:
    """The float32 values of whole experts, [experts, groups*32, rows] flat into `out`
    (float32, at least that long), from their blocks (uint8, [experts, rows, groups, 16],
    flat) and scales (uint8, [experts, rows, groups], flat)."""
    experts = scales.size // (rows * groups)
    codes = blocks.reshape(experts, rows, groups, GROUP // 2)
    exponents = scales.reshape(experts, rows, groups, 1).astype(np.int32) - BIAS
    unpacked = np.empty((experts, rows, groups, GROUP), np.float32)
    with np.errstate(over="ignore"):
        unpacked[..., 0::2] = np.ldexp(E2M1[codes & 0x0F], exponents)
        unpacked[..., 1::2] = np.ldexp(E2M1[codes >> 4], exponents)
    unpacked[(exponents == NAN_SCALE - BIAS) | ~np.isfinite(unpacked)] = np.nan
    values = out[: experts * groups * GROUP * rows].reshape(experts, groups * GROUP, rows)
    values[:] = unpacked.reshape(experts, rows, groups * GROUP).transpose(0, 2, 1)
    return values.reshape(-1)
