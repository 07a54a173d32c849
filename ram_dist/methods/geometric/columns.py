"""Exact sums of float32 products per column of a tensor, compact enough to be a reduce
statistic of every column at once (nuslerp's vectors along the first dimension).

`exact_sums` keeps one int64 bin per float64 exponent (2077 per sum): right for a handful of
whole-tensor sums, too large for one sum per column of a matrix (16 KiB a column). A product
of two float32 values is never below 2**-298 in magnitude (unless zero) nor above 2**256, so
its exact value `sig * 2**(E - 1075)` (E its float64 biased exponent, from 725 to 1278) is a
multiple of 2**-350 below 2**606. Here it is cut into three pieces of 21 bits of `sig`, each
shifted into place and added to one of 40 int64 limbs of 16 bits (a piece spans at most
three limbs' worth of bits, but is added whole to its lowest limb: an addend below 2**36).
Limbs are never carried, so a limb stays exact for up to 2**27 rows, and the sums of any
split of the rows add up to the same integers. NaN and infinite products are counted in
three extra slots, as `exact_sums` does. The driver rebuilds each column's exact value as a
Python integer and rounds it once to float64 (`values`). The layout and the fused path's
numba kernel (`fused_column_sums`) are `ram_dist.kernels.column_sums`'.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ram_dist.kernels.column_sums import (  # the limbs' layout; the fused path's kernel
    _LIMB,
    _LIMBS,
    _LOWEST,
    _NAN,
    _NEG_INF,
    _PIECE,
    _POS_INF,
    _SCALE,
    SLOTS,
    fused_column_sums,
)


def column_sums(x: torch.Tensor, y: torch.Tensor, columns: int) -> torch.Tensor:
    """int64[columns, SLOTS]: the exact sums of x * y down each column of the flat chunks x
    and y (float32 values; whole rows of `columns` elements)."""
    import torch

    a = x.reshape(-1).to(torch.float32).to(torch.float64)
    b = y.reshape(-1).to(torch.float32).to(torch.float64)
    bits = (a * b).view(torch.int64)
    negative = bits < 0
    exponent = (bits >> 52) & 0x7FF
    frac = bits & ((1 << 52) - 1)
    finite = exponent < 0x7FF
    sig = torch.where(exponent > 0, frac | (1 << 52), frac)
    sig = torch.where(finite, sig, torch.zeros_like(sig))
    q = torch.clamp(exponent - _LOWEST, min=0)
    column = torch.arange(a.numel(), device=a.device) % columns
    out = torch.zeros(columns * SLOTS, dtype=torch.int64, device=a.device)
    for k in range(3):
        piece = (sig >> (_PIECE * k)) & ((1 << _PIECE) - 1)
        place = q + _PIECE * k
        addend = piece << (place & (_LIMB - 1))
        out.index_add_(0, column * SLOTS + place // _LIMB, torch.where(negative, -addend, addend))
    special = torch.where(frac != 0, _NAN, torch.where(negative, _NEG_INF, _POS_INF))
    counted = (~finite).to(torch.int64)
    out.index_add_(0, column * SLOTS + torch.where(finite, 0, special), counted)
    return out.reshape(columns, SLOTS)


def values(stat: Any) -> list[float]:
    """Each column's exact sum rounded once to float64 (inf, -inf or nan where a product
    was one)."""
    rows = stat.tolist() if not isinstance(stat, list) else stat
    out = []
    for limbs in rows:
        nan, pos, neg = limbs[_NAN], limbs[_POS_INF], limbs[_NEG_INF]
        if nan or (pos and neg):
            out.append(math.nan)
        elif pos or neg:
            out.append(math.inf if pos else -math.inf)
        else:
            total = sum(limbs[j] << (_LIMB * j) for j in range(_LIMBS) if limbs[j])
            out.append(float(Fraction(total, 1 << _SCALE)))
    return out


__all__ = ["SLOTS", "column_sums", "fused_column_sums", "values"]
