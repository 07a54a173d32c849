"""Exact sums of float32 products: equal to `math.fsum` of the float64 products rounded once,
for any split of the elements, with infinities and NaN as an exact sum would give them."""

from __future__ import annotations

import math

import pytest
import torch

from ram_dist.methods import exact_sums

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _values(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values over most of float32's exponent range, subnormals and zeros included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 120, (n,), generator=g))
    y = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 120, (n,), generator=g))
    x[::97] = 0.0
    x[1] = 1e-45  # the smallest subnormal
    y[1] = -3e-39
    return x.float(), y.float()


def _fsum(x: torch.Tensor, y: torch.Tensor | None = None) -> float:
    y = x if y is None else y
    return math.fsum(float(a) * float(b) for a, b in zip(x.tolist(), y.tolist(), strict=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dot_products_and_squares_are_fsum_for_any_split(seed):
    x, y = _values(20011, seed)
    whole = exact_sums.product_sum(x, y)
    assert exact_sums.value(whole) == _fsum(x, y)
    assert exact_sums.value(exact_sums.product_sum(x)) == _fsum(x)
    for cut in (1, 333, 10000, 20010):
        parts = exact_sums.product_sum(x[:cut], y[:cut]) + exact_sums.product_sum(x[cut:], y[cut:])
        assert torch.equal(parts, whole)


def test_cancellation_is_exact():
    """A sum that cancels to a tiny value keeps it (a float accumulator would lose it)."""
    x = torch.tensor([2.0**100, 1.0, -(2.0**100)], dtype=torch.float32)
    y = torch.tensor([1.0, 2.0**-100, 1.0], dtype=torch.float32)
    assert exact_sums.value(exact_sums.product_sum(x, y)) == 2.0**-100


def test_any_float_dtype_is_first_rounded_to_float32():
    x = torch.tensor([1.0 + 2.0**-30], dtype=torch.float64)
    assert exact_sums.value(exact_sums.product_sum(x)) == 1.0
    h = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    assert exact_sums.value(exact_sums.product_sum(h)) == 1.5**2 + 2.25**2


@pytest.mark.parametrize(
    ("x", "y", "expected"),
    [
        ([math.inf, 1.0], [1.0, 2.0], math.inf),
        ([math.inf, 1.0], [-1.0, 2.0], -math.inf),
        ([math.inf, -math.inf], [1.0, 1.0], math.nan),
        ([math.inf, 1.0], [0.0, 1.0], math.nan),
        ([math.nan, 1.0], [1.0, 1.0], math.nan),
    ],
)
def test_infinities_and_nan(x, y, expected):
    got = exact_sums.value(exact_sums.product_sum(torch.tensor(x), torch.tensor(y)))
    assert got == expected or (math.isnan(expected) and math.isnan(got))


def test_row_sums_of_a_chunk_of_whole_and_partial_rows():
    x, y = _values(700, 3)
    row = 64
    first, rows = exact_sums.row_sums(x[100:], y[100:], 100, row)
    assert first == 1 and rows.shape == (10, exact_sums.BINS)
    for r in range(1, 11):
        lo, hi = max(r * row, 100), (r + 1) * row
        assert exact_sums.value(rows[r - 1]) == _fsum(x[lo:hi], y[lo:hi])
