"""compressed-tensors' packed INT4/INT8 weights decoded (numba): `kernels.int_packed.decode`'s
values, rounded to the scale's dtype, written as its 16-bit bits in one pass over the words,
with no float32 copy of the values.

Each value is `float32(q - zero) * scale`, one float32 multiplication (exact for 4- and 8-bit
codes and a 16-bit scale), then rounded to nearest even to bfloat16 or float16
(`primitives.float_bits_to_bf16`, `float_bits_to_half`): the numpy rule's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import OPTIONS, bits, float_bits_to_bf16, float_bits_to_half
from ram_dist.kernels.shared_cache import share_compiles

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: What `_decode` writes: bfloat16 or float16 bits.
BF16, F16 = 0, 1


@njit(cache=True, **OPTIONS)
def _decode(words, bits_per_code, cols, scales, zeros, has_zeros, kind, out):  # noqa: ANN001, ANN201
    """out[r * cols + c] (uint16 bits) for every row whose words are given (uint8, flat);
    `scales` float32 [rows or 1, G], `zeros` int16 of the same shape (read if `has_zeros`)."""
    groups = scales.shape[1]
    rows = out.size // cols
    per_row = words.size // rows
    size = cols // groups
    offset = np.int32(1) << np.int32(bits_per_code - 1)
    for r in range(rows):
        at = r * per_row
        sr = r if scales.shape[0] > 1 else 0
        for g in range(groups):
            s = scales[sr, g]
            z = np.int32(zeros[sr, g]) if has_zeros else np.int32(0)
            for c in range(g * size, (g + 1) * size):
                if bits_per_code == 8:
                    q = np.int32(words[at + c])
                else:
                    byte = np.int32(words[at + (c >> 1)])
                    q = (byte >> np.int32(4)) if c & 1 else (byte & np.int32(15))
                v = np.float32(q - offset - z) * s
                u = bits(v)
                h = float_bits_to_bf16(u, -1) if kind == BF16 else float_bits_to_half(u)
                out[r * cols + c] = np.uint16(h)


def decode_16(
    words: np.ndarray,
    bits_per_code: int,
    cols: int,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    kind: int,
    out: np.ndarray,
) -> np.ndarray:
    """The 16-bit bits (uint16, into `out`: rows * cols long) of the rows' values."""
    z = zeros if zeros is not None else np.zeros((1, 1), np.int16)
    _decode(words, bits_per_code, cols, scales, z, zeros is not None, kind, out)
    return out


KERNELS = (_decode,)


def warm_calls() -> Iterator[Call]:
    """compressed-tensors' packed INT4/INT8 weights decoded (one signature: bytes in, 16-bit
    bits out) (`kernels.warm`)."""
    packed = partial(
        decode_16, np.zeros(16, np.uint8), 4, 32, np.ones((1, 1), np.float32), None, BF16,
        np.empty(32, np.uint16),
    )  # fmt: skip
    yield _decode, "INT4/INT8", packed


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
