"""What DARE's and DELLA's fused kernels share (numba, compiled into each caller): an
element's random draw as `rng.random_bits` makes it, and the bin of DARE's L1 statistic
(`dare.l1_statistic`) that a value adds to. One copy, so the two kernels' draws and bins
cannot drift apart from each other or from the eager rule."""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

from ram_dist.kernels.primitives import ABS32, bits

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)
#: What a NaN adds to bin 255: more than any count of infinities in a chunk.
NAN_UNIT = np.int64(1 << 32)


@register_jitable
def draw_bits(index: int, key: np.uint64) -> np.uint64:
    """The 24-bit draw of flat element `index` in the stream `key`: splitmix64 of
    `index * GOLDEN + key` in wrapping uint64 arithmetic, its top 24 bits."""
    z = _U64(index) * _GOLDEN + key
    z = (z ^ (z >> _U64(30))) * _MUL1
    z = (z ^ (z >> _U64(27))) * _MUL2
    z = z ^ (z >> _U64(31))
    return z >> _U64(40)


@register_jitable
def l1_bin(d: np.float32) -> tuple[int, np.int64]:
    """`dare.l1_statistic` of one value: its bin (the float32 exponent) and what it adds
    there (its significand; 1 for an infinity, `NAN_UNIT` for a NaN)."""
    b = bits(d) & ABS32
    e = np.int64(b >> 23)
    frac = np.int64(b & 0x7FFFFF)
    if e == 255:
        return 255, np.int64(1) if frac == 0 else NAN_UNIT
    return e, (frac | 0x800000) if e > 0 else frac
