"""The numba exact sums (`kernels.exact_sums`) give the eager rule's bins, bin for bin:
whole vectors and per row, with subnormals, zeros, infinities and NaN; and the exact sum of
the products (exact rationals, `math.fsum`) on the vectorized path, one addend or two."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from ram_dist.methods import exact_sums

pytest.importorskip("numba")

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _stack(n: int, rows: int = 3) -> np.ndarray:
    g = torch.Generator().manual_seed(n)
    scale = torch.exp2(torch.randint(-140, 120, (rows, n), generator=g).float())
    x = torch.randn(rows, n, generator=g) * scale
    x[0, 5] = math.inf
    x[1, 9] = -math.inf
    x[2, 11] = math.nan
    x[1, 13] = 1e-45
    x[:, 17] = 0.0
    return x.numpy().astype(np.float32)


@pytest.mark.parametrize("n", [1, 511, 512, 1500])
def test_gram_is_the_eager_rules_bins(n):
    if n < 20:
        stack = np.array([[2.5], [-3.0], [1e-40]], dtype=np.float32)
    else:
        stack = _stack(n)
    pairs = exact_sums.pairs_of(3)
    got = exact_sums.gram(stack, pairs)
    for (i, j), bins in zip(pairs, got, strict=True):
        want = exact_sums.product_sum(torch.from_numpy(stack[i]), torch.from_numpy(stack[j]))
        assert np.array_equal(bins, want.numpy()), (i, j)


def test_row_gram_is_gram_of_each_row():
    stack = _stack(3 * 700)
    pairs = [(0, 1), (2, 2)]
    got = exact_sums.row_gram(stack, pairs, 700)
    assert got.shape == (3, 2, exact_sums.BINS)
    for r in range(3):
        rows = stack[:, r * 700 : (r + 1) * 700]
        assert np.array_equal(got[r], exact_sums.gram(rows, pairs))


# ---- the vectorized path: one addend or two, at the edges, against exact references ----

TILE = 1024  # `exact_sums_numba.TILE`: the cases below cross tile boundaries

F32 = np.finfo(np.float32)
EDGES = [
    float(F32.max), -float(F32.max), float(F32.tiny), -float(F32.tiny),  # largest, 2**-126
    float(F32.smallest_subnormal), -float(F32.smallest_subnormal),  # 2**-149
    float(np.float32(3.5e-39)), 1.0, -1.0, 0.0, -0.0,
    float(np.float32(1 + 2**-23)), -float(np.float32(2 - 2**-23)),  # 24 significant bits
]  # fmt: skip


def _exact_products(stack: np.ndarray, i: int, j: int) -> Fraction:
    """The exact sum of stack[i] * stack[j], from Python's exact rationals."""
    a, b = (stack[k].astype(np.float64).tolist() for k in (i, j))
    return sum((Fraction(x) * Fraction(y) for x, y in zip(a, b, strict=True)), Fraction(0))


def _fsum_products(stack: np.ndarray, i: int, j: int) -> float:
    """math.fsum of the products, each exact in float64: the exact sum rounded once."""
    return math.fsum((stack[i].astype(np.float64) * stack[j].astype(np.float64)).tolist())


def _check(stack: np.ndarray) -> None:
    """gram's bins are the eager rule's, and they stand for the exact sum of each pair."""
    pairs = exact_sums.pairs_of(stack.shape[0])
    got = exact_sums.gram(stack, pairs)
    for (i, j), bins in zip(pairs, got, strict=True):
        x, y = torch.from_numpy(stack[i].copy()), torch.from_numpy(stack[j].copy())
        assert np.array_equal(bins, exact_sums.product_sum(x, y).numpy()), (i, j)
        assert exact_sums.exact(bins) == _exact_products(stack, i, j), (i, j)
        assert exact_sums.value(bins) == _fsum_products(stack, i, j), (i, j)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """float32 values representable in `dtype` (bfloat16, float16 or float32)."""
    return x.to(dtype).to(torch.float32).numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gram_of_each_dtype_is_the_exact_sum(dtype):
    """bfloat16 and float16 values take the one-addend path (16 and 22 significant bits a
    product), float32 the two-addend one; every product's magnitude from tiny to large."""
    g = torch.Generator().manual_seed(7)
    n = 3 * TILE + 77
    scale = torch.exp2(torch.randint(-20, 12, (3, n), generator=g).float())
    stack = _rounded(torch.randn(3, n, generator=g) * scale, dtype)
    stack[:, ::5] = 0.0  # zero products between the others
    _check(stack)


def test_edges_one_and_two_addends_mixed():
    """The largest finite value, the smallest normal and subnormal, signed zeros and
    24-bit significands, beside one-addend (bfloat16) tiles: every product of every pair."""
    g = torch.Generator().manual_seed(11)
    n = 4 * TILE
    stack = _rounded(torch.randn(3, n, generator=g) * 0.02, torch.bfloat16)
    edges = np.array(EDGES, dtype=np.float32)
    for r in range(3):  # the second tile: every product of two edge values
        m = len(edges)
        stack[r, TILE : TILE + m * m] = np.tile(edges, m) if r else np.repeat(edges, m)
    stack[2, 2 * TILE : 3 * TILE] = (torch.randn(TILE, generator=g) / 3).numpy()  # 24 bits
    _check(stack)


@pytest.mark.parametrize("bits", [16, 17])
def test_the_one_addend_boundary(bits):
    """11- and 16-bit values: products of at most 27 bits, one addend; 11- and 17-bit ones:
    some of 28 bits, whose low addend is not zero (two addends)."""
    a = np.float32(2 - 2.0**-10)  # 11 significant bits
    b = np.float32(2 - 2.0 ** (1 - bits))  # `bits` significant bits
    stack = np.array([[a, 1.0, a] * TILE, [b, -b, b] * TILE], dtype=np.float32)
    stack[0, 5] = 3.0
    _check(stack)


def test_subnormal_inputs_and_lone_values():
    """Only subnormal values in a tile, a tile of zeros, and one value in a tile."""
    stack = np.zeros((2, 3 * TILE), dtype=np.float32)
    sub = np.float32(F32.smallest_subnormal)
    stack[0, :TILE] = sub * np.arange(1, TILE + 1, dtype=np.float32)
    stack[1, :TILE] = -sub * np.arange(TILE, 0, -1, dtype=np.float32)
    stack[:, 2 * TILE + 3] = [F32.max, -F32.max]
    _check(stack)


def test_cancellation_to_zero():
    """Products that cancel exactly, in one addend and in two: every bin sums to zero."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = _rounded(torch.randn(TILE + 9, generator=g), dtype)
        stack = np.stack([np.concatenate([x, x]), np.concatenate([x, -x])])
        got = exact_sums.gram(stack, [(0, 1)])[0]
        assert not got.any()
        assert exact_sums.value(got) == 0.0 == _fsum_products(stack, 0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sparse_rows_as_task_vectors(dtype):
    """Rows mostly zero (a task vector's unchanged elements), as the kernel sums them from
    the sparser row's non-zero values only: 3 %, 40 %, 70 % and all non-zero, signed zeros
    among them, in float32 products (bfloat16 and float16 agents' updates) and float64 ones
    (their wider updates, float32's)."""
    g = torch.Generator().manual_seed(13)
    n = 3 * TILE + 101
    base = torch.randn(n, generator=g) * 0.02
    rows = []
    for density in (0.03, 0.4, 0.7, 1.0):
        agent = base + torch.randn(n, generator=g) * 1e-3
        agent = torch.where(torch.rand(n, generator=g) < density, agent, base)
        rows.append(_rounded(agent, dtype) - _rounded(base, dtype))
    stack = np.stack(rows)
    stack[1, 7] = -0.0
    _check(stack)


@pytest.mark.parametrize("low", [-63, -64])
def test_the_float32_products_range(low):
    """bfloat16 values whose products reach float32's smallest normal, 2**-126, and its
    largest binade below 2**128 (formed in float32), or fall below it (formed in float64):
    the same bins either way."""
    g = torch.Generator().manual_seed(17)
    x = _rounded(torch.randn(2, 2 * TILE, generator=g), torch.bfloat16)
    top = float(np.float32(2 - 2.0**-7) * np.float32(2.0**63))  # 8 bits, field 190
    x[0, 3], x[1, 3] = 2.0**-63, 2.0**low
    x[0, 4], x[1, 4] = 2.0**-63, -(2.0**low) * 1.5
    x[0, 9], x[1, 9] = top, top
    x[0, TILE + 1], x[1, TILE + 1] = -top, top
    x[0, :2] = x[1, :2] = 2.0**-63  # the smallest field in the tile: 64 (or 63)
    stack = np.ascontiguousarray(x)
    stack[1, :2] = 2.0**low
    _check(stack)


@pytest.mark.parametrize(
    ("special", "want"),
    [(math.inf, math.inf), (-math.inf, -math.inf), (math.nan, math.nan)],
)
def test_infinity_and_nan_as_the_eager_rule(special, want):
    """A tile with an infinity or NaN counts them as the eager rule does (inf * 0 is NaN);
    the other tiles keep the vectorized path."""
    g = torch.Generator().manual_seed(5)
    stack = _rounded(torch.randn(2, 3 * TILE, generator=g), torch.bfloat16)
    stack[0, TILE + 4], stack[1, TILE + 4] = special, 1.5
    _check_bins_only(stack)
    value = exact_sums.value(exact_sums.gram(stack, [(0, 1)])[0])
    assert value == want or (math.isnan(want) and math.isnan(value))
    stack[1, TILE + 4] = 0.0  # special * 0: NaN
    assert math.isnan(exact_sums.value(exact_sums.gram(stack, [(0, 1)])[0]))
    _check_bins_only(stack)


def _check_bins_only(stack: np.ndarray) -> None:
    pairs = exact_sums.pairs_of(stack.shape[0])
    for (i, j), bins in zip(pairs, exact_sums.gram(stack, pairs), strict=True):
        x, y = torch.from_numpy(stack[i].copy()), torch.from_numpy(stack[j].copy())
        assert np.array_equal(bins, exact_sums.product_sum(x, y).numpy()), (i, j)


@pytest.mark.parametrize("row", [1, 300, TILE, TILE + 333])
def test_row_gram_is_the_eager_rules_rows(row):
    """Rows shorter and longer than a tile, mixing bfloat16 and float32 values: the eager
    rule's bins per row, each the exact sum of its products."""
    g = torch.Generator().manual_seed(row)
    rows = 3 if row > 1 else 50
    x = torch.randn(2, rows * row, generator=g) * 0.05
    stack = np.concatenate([_rounded(x[:, : rows * row // 2], torch.bfloat16),
                            x[:, rows * row // 2 :].numpy()], axis=1)  # fmt: skip
    stack = np.ascontiguousarray(stack)
    pairs = [(0, 0), (0, 1), (1, 1)]
    got = exact_sums.row_gram(stack, pairs, row)
    for k, (i, j) in enumerate(pairs):
        xi, xj = torch.from_numpy(stack[i].copy()), torch.from_numpy(stack[j].copy())
        first, want = exact_sums.row_sums(xi, xj, 0, row)
        assert first == 0 and np.array_equal(got[:, k], want.numpy()), (i, j)
        for r in (0, rows - 1):
            part = stack[:, r * row : (r + 1) * row]
            assert exact_sums.exact(got[r, k]) == _exact_products(part, i, j)


def test_no_fused_multiply_add():
    """No FMA in the kernels' code (`fma_check.fma_findings`)."""
    from ram_dist.kernels import exact_sums_numba
    from ram_dist.kernels.fma_check import fma_findings

    stack = np.ones((2, 8), np.float32)
    pairs = np.array([[0, 1]], np.int64)
    for name in ("gram", "row_gram"):
        fresh = getattr(exact_sums_numba, name)
        out = np.zeros((1, exact_sums.BINS) if name == "gram" else (2, 1, exact_sums.BINS),
                       np.int64)  # fmt: skip
        args = (stack, pairs, 26, exact_sums._POS_INF, out)
        fresh(*args) if name == "gram" else fresh(stack, pairs, 4, *args[2:])
        assert fresh.signatures and fma_findings(fresh) == [], name
