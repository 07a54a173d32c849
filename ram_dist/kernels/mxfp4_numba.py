"""MXFP4 decoding (numba): `kernels.mxfp4.decode`'s values, as bfloat16 bits, in one pass
over the blocks and scales with no temporaries.

Every MXFP4 value, an e2m1 code times a power of two, is exact in bfloat16 (at most two
significant bits, any float32 exponent), so the bits are the float32 value's top half. The
values are the unpacked codes transposed ([rows, groups*32] per expert read, [groups*32,
rows] written): a tile of `TILE` rows of one group is unpacked into a [32, TILE] scratch and
written out as 32 runs of `TILE` contiguous values, so that the writes stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.mxfp4 import E2M1, GROUP, NAN_SCALE
from ram_dist.kernels.primitives import INF32, OPTIONS, bits, float32_of
from ram_dist.kernels.shared_cache import share_compiles

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Rows of one group unpacked at once.
TILE = 64
#: bfloat16's quiet NaN: a scale byte of 255, or a value beyond float32.
NAN_BF16 = np.uint16(0x7FC0)
_MAGNITUDES = np.abs(E2M1[:8])


@njit(cache=True, **OPTIONS)
def _decode(blocks, scales, rows, groups, out):  # noqa: ANN001, ANN201  (numba arrays)
    """out[e, c, r] (uint16 bfloat16 bits, flat) of every expert whose blocks and scales
    are given (flat uint8)."""
    experts = scales.size // (rows * groups)
    cols = groups * GROUP
    tile = np.empty((GROUP, TILE), np.uint16)
    for e in range(experts):
        for g in range(groups):
            for r0 in range(0, rows, TILE):
                n = min(TILE, rows - r0)
                for j in range(n):
                    at = (e * rows + r0 + j) * groups + g
                    s = np.int32(scales[at])
                    # 2**(s - 127) exactly: a normal float32 from its exponent bits, or 2**-127
                    factor = float32_of(np.uint32(s) << np.uint32(23)) if s > 0 else _MIN
                    codes = blocks[at * (GROUP // 2) : (at + 1) * (GROUP // 2)]
                    for k in range(GROUP // 2):
                        byte = np.uint32(codes[k])
                        for h in range(2):
                            code = (byte >> np.uint32(4 * h)) & np.uint32(0xF)
                            v = bits(_MAGNITUDES[code & np.uint32(7)] * factor)
                            v |= (code & np.uint32(8)) << np.uint32(28)
                            bad = s == NAN_SCALE or (v & INF32) == INF32
                            tile[2 * k + h, j] = NAN_BF16 if bad else np.uint16(v >> np.uint32(16))
                for i in range(GROUP):
                    at = (e * cols + g * GROUP + i) * rows + r0
                    out[at : at + n] = tile[i, :n]


_MIN = np.float32(2.0**-127)


def decode_bf16(
    blocks: np.ndarray, scales: np.ndarray, rows: int, groups: int, out: np.ndarray
) -> np.ndarray:
    """The bfloat16 bits (uint16) of whole experts' values, [experts, groups*32, rows] flat
    into `out` (uint16, at least that long), from their flat uint8 blocks and scales."""
    n = scales.size * GROUP
    _decode(blocks, scales, rows, groups, out[:n])
    return out[:n]


KERNELS = (_decode,)


def warm_calls() -> Iterator[Call]:
    """gpt-oss's MXFP4 weights decoded (one signature: bytes in, bfloat16 bits out)
    (`kernels.warm`)."""
    codes, exponents = np.zeros(2 * 16, np.uint8), np.full(2, 127, np.uint8)
    decode = partial(decode_bf16, codes, exponents, 2, 1, np.empty(64, np.uint16))
    yield _decode, "MXFP4", decode


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
