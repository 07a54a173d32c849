"""Exact sums of float32 products (dot products, squared norms), as reduce statistics.

Float addition is not associative, so a float accumulator summed chunk by chunk depends on
the chunks. The spec instead sums exactly: each product of two float32 values is exact in
float64 (24 + 24 significant bits), and the products are added without rounding error. A
statistic is int64 bins, one per float64 exponent: a product `sig * 2**(E - 1075)` (E its
biased exponent, at least 1; sig < 2**53 its integer significand) adds `sig mod 2**26` to
bin E and `sig >> 26` to bin E + 26, with its sign. Each addend is below 2**27, so a bin
cannot overflow below 2**36 elements per tensor; sums of integers are associative, so the
total is the same for any split, order, worker count or device. The driver rebuilds the
exact value as a Python integer and rounds it once to float64 (`value`). The bins' layout and
the fused path's numba kernels (`gram`, `row_gram`, on numpy arrays) are
`ram_dist.kernels.exact_sums`'; this module is the eager rule (torch, any device) and the
driver's side.

Products that are not finite (an Inf or NaN input) are counted in three bins of their own
(+inf, -inf, NaN), so the value is inf, -inf or nan as an exact sum would be.

Row-wise statistics (`row_sums`) are the same bins per row of the tensor, for methods that
take norms or dot products of each row; a chunk may hold parts of rows (the row index of
each element is its flat index // row length), since partial row sums add up exactly.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from ram_dist.kernels.exact_sums import (  # the bins' layout; the fused path's kernels
    _EXPONENTS,
    _NAN,
    _NEG_INF,
    _POS_INF,
    _SPLIT,
    BINS,
    gram,
    pairs_of,
    row_gram,
)

if TYPE_CHECKING:
    import torch

_BIAS = 1075  # float64: value = sig * 2**(E - 1075) for E >= 1


def _products(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """The products x * y (x * x without y), exact in float64, flat."""
    import torch

    a = x.reshape(-1).to(torch.float32).to(torch.float64)
    if y is None:
        return a * a
    b = y.reshape(-1).to(torch.float32).to(torch.float64)
    return a * b


def _binned(products: torch.Tensor, group: torch.Tensor | None, groups: int) -> torch.Tensor:
    """int64[groups, BINS]: each product's two addends in its group's row of bins."""
    import torch

    bits = products.view(torch.int64)
    negative = bits < 0
    exponent = (bits >> 52) & 0x7FF
    frac = bits & ((1 << 52) - 1)
    finite = exponent < 0x7FF
    sig = torch.where(exponent > 0, frac | (1 << 52), frac)
    sig = torch.where(negative, -sig, sig)
    low = torch.where(sig < 0, -((-sig) & ((1 << _SPLIT) - 1)), sig & ((1 << _SPLIT) - 1))
    high = torch.where(sig < 0, -((-sig) >> _SPLIT), sig >> _SPLIT)
    position = torch.clamp(exponent, min=1)
    special = torch.where(frac != 0, _NAN, torch.where(negative, _NEG_INF, _POS_INF))
    zero = torch.zeros_like(sig)
    low_bin = torch.where(finite, position, special)
    low = torch.where(finite, low, torch.ones_like(sig))
    high_bin = torch.where(finite, position + _SPLIT, special)
    high = torch.where(finite, high, zero)
    if group is not None:
        low_bin = low_bin + group * BINS
        high_bin = high_bin + group * BINS
    out = torch.zeros(groups * BINS, dtype=torch.int64, device=products.device)
    out.index_add_(0, low_bin, low)
    out.index_add_(0, high_bin, high)
    return out.reshape(groups, BINS)


def product_sum(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """int64[BINS]: the exact sum of x * y over all elements (of x * x without y); x and y
    are float32 values (any float dtype is first rounded to float32)."""
    return _binned(_products(x, y), None, 1)[0]


def row_sums(
    x: torch.Tensor, y: torch.Tensor | None, start: int, row: int
) -> tuple[int, torch.Tensor]:
    """The exact sums of x * y per row, for a flat chunk that starts at flat index `start`
    of a tensor whose rows hold `row` elements: (first row, int64[rows, BINS]) for the
    rows the chunk touches."""
    import torch

    products = _products(x, y)
    first = start // row
    index = torch.arange(start, start + products.numel(), device=products.device) // row
    index = index - first
    rows = int(index[-1]) + 1 if products.numel() else 0
    return first, _binned(products, index, rows)


def exact(stat: torch.Tensor | np.ndarray | list[int]) -> Fraction | float:
    """The exact sum a statistic stands for (inf, -inf or nan when a product was one).
    Only its non-zero bins are read: a row's products span a few exponents of the 2074."""
    bins = np.asarray(stat.cpu() if hasattr(stat, "cpu") else stat, dtype=np.int64)
    nan, pos, neg = int(bins[_NAN]), int(bins[_POS_INF]), int(bins[_NEG_INF])
    if nan or (pos and neg):
        return math.nan
    if pos or neg:
        return math.inf if pos else -math.inf
    used = np.flatnonzero(bins[1:_EXPONENTS]) + 1
    units = sum(int(bins[e]) << (int(e) - 1) for e in used)
    return Fraction(units, 1 << (_BIAS - 1))


def value(stat: torch.Tensor | np.ndarray | list[int]) -> float:
    """The exact sum rounded once to float64 (to nearest, ties to even)."""
    return float(exact(stat))


__all__ = ["BINS", "exact", "gram", "pairs_of", "product_sum", "row_gram", "row_sums", "value"]
