"""The LoRA product kernel (`kernels.lora`, `kernels.lora_numba`): the spec's fixed order,
step by step in float32 scalars, byte for byte on both paths, with no fused multiply-add."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from lora_steps import product_by_hand

from ram_dist.kernels import fma_check, lora, lora_numba

NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def _stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values stored as `dtype` (bfloat16 rounded to nearest even), as bytes."""
    return lora.cast(values.astype(np.float32), dtype, np.empty(values.size * 4, np.uint8)).copy()


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize(("start", "stop"), [(0, 13 * 11), (5, 40), (22, 23), (11 * 3, 11 * 9 + 4)])
def test_both_paths_follow_the_rule_step_by_step(dtype, start, stop):
    rng = np.random.default_rng(7)
    rows, cols, r = 13, 11, 6
    coef = rng.standard_normal((rows, r)).astype(np.float32)
    basis = rng.standard_normal((r, cols)).astype(np.float32)
    theta = _stored(rng.standard_normal(rows * cols), dtype)
    isz = np.dtype(NUMPY[dtype]).itemsize
    part = theta[start * isz : stop * isz]
    scale = np.float32(0.3)
    got = {
        fast: lora.values(part, dtype, coef[start // cols :], basis, scale, start, "F32",
                          np.empty((stop - start) * 4, np.uint8), fast=fast).copy()
        for fast in (True, False)
    }  # fmt: skip
    base = lora.as_float32(part, dtype)
    want = product_by_hand(base, coef[start // cols :], basis, scale, start)
    assert got[True].tobytes() == got[False].tobytes() == want.tobytes()


def test_the_order_is_fixed_not_a_matrix_multiply():
    """Values where summing in another order gives another float32: the kernels keep k
    ascending (a BLAS product, or float64, would not)."""
    coef = np.array([[1.0, 1.0, 1.0]], np.float32)
    basis = np.array([[2.0**24], [1.0], [-(2.0**24)]], np.float32)  # 2**24 + 1 rounds to 2**24
    theta = np.zeros(1, np.float32).view(np.uint8)
    for fast in (True, False):
        out = lora.values(theta, "F32", coef, basis, np.float32(1), 0, "F32",
                          np.empty(4, np.uint8), fast=fast)  # fmt: skip
        assert out.view(np.float32)[0] == 0.0  # (2**24 + 1) - 2**24 in float32, k ascending
    assert (coef @ basis)[0, 0] in (0.0, 1.0)  # whatever a matrix multiply's order gives


def test_no_fused_multiply_add_in_the_compiled_kernel():
    """An FMA would round `c * basis + acc` once where the spec rounds twice; fastmath stays
    off, and the compiled code of every signature used holds none."""
    rng = np.random.default_rng(0)
    coef = rng.standard_normal((4, 3)).astype(np.float32)
    basis = rng.standard_normal((3, 5)).astype(np.float32)
    for dtype in ("BF16", "F16", "F32"):
        theta = _stored(rng.standard_normal(20), dtype)
        lora.values(theta, dtype, coef, basis, np.float32(2), 0, dtype, np.empty(80, np.uint8))
    assert lora_numba.lora_values.signatures
    assert lora_numba.fma_instructions() == []


def test_an_fma_would_change_these_values():
    """The check above has teeth: here the second step, `acc + a * a`, rounds `a * a` first
    (a tie, to even) and so differs from one rounding of the whole."""
    a = np.float32(1 + 2**-12)  # a * a = 1 + 2**-11 + 2**-24: halfway between two float32s
    two_roundings = np.float32(np.float32(-1) + np.float32(a * a))
    one_rounding = np.float32(np.float64(a) * np.float64(a) - 1)
    assert two_roundings == 2**-11 and one_rounding == 2**-11 + 2**-24
    coef = np.array([[1, a]], np.float32)
    basis = np.array([[-1], [a]], np.float32)
    for fast in (True, False):
        out = lora.values(np.zeros(1, np.float32).view(np.uint8), "F32", coef, basis,
                          np.float32(1), 0, "F32", np.empty(4, np.uint8), fast=fast)  # fmt: skip
        assert out.view(np.float32)[0] == two_roundings


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_the_cast_rounds_to_nearest_even(dtype):
    """The last step rounds float32 to the task's dtype as torch's `.to(dtype)` does."""
    import torch

    values = np.random.default_rng(3).standard_normal(1000).astype(np.float32) * 100
    got = lora.cast(values, dtype, np.empty(4000, np.uint8))
    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    want = torch.from_numpy(values).to(torch_dtype).view(torch.uint8).numpy()
    assert got.tobytes() == want.tobytes()


def _both_paths(
    seed: int, shape: tuple[int, int, int], dtype: str, scale: float, span: tuple[int, int]
) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """Random `coef` [rows, r], `basis` [r, cols] and base values of `dtype` (`shape`: rows,
    cols, r), the product kernel over elements `span` on the fast path and the plain one:
    their bytes, asserted the same; and the inputs (theta: the span's stored bytes)."""
    rng = np.random.default_rng(seed)
    (rows, cols, r), (start, stop) = shape, span
    coef = rng.standard_normal((rows, r)).astype(np.float32)
    basis = rng.standard_normal((r, cols)).astype(np.float32)
    isz = np.dtype(NUMPY[dtype]).itemsize
    theta = _stored(rng.standard_normal(rows * cols), dtype)[start * isz : stop * isz]
    got = [
        lora.values(theta, dtype, coef[start // cols :], basis, np.float32(scale), start, dtype,
                    np.empty((stop - start) * 4, np.uint8), fast=fast).tobytes()
        for fast in (True, False)
    ]  # fmt: skip
    assert got[0] == got[1]
    return got[0], theta, coef, basis


@pytest.mark.parametrize(("start", "stop"), [(0, 9 * 300), (300, 9 * 300), (299, 2401), (601, 899)])
def test_wide_rows_four_at_a_time_and_in_tiles(start, stop):
    """Rows wider than the kernel's tile, whole rows four at a time and partial rows alone:
    the same bytes as the numpy rule (which computes whole rows at once)."""
    _both_paths(11, (9, 300, 5), "BF16", 1.5, (start, stop))


@pytest.mark.parametrize(("start", "stop"), [(0, 11 * 327), (5, 11 * 327 - 3), (671, 2389)])
def test_register_blocks_at_rank_64_and_their_edges(start, stop):
    """Rank 64 over rows of 327 columns: whole blocks of 16 columns (four rows) and of 64
    (a row alone, from a column that is not a block's first), and the columns around them:
    the same bytes as the numpy rule, and as the rule step by step."""
    got, theta, coef, basis = _both_paths(12, (11, 327, 64), "F32", 0.7, (start, stop))
    if start == 671:
        want = product_by_hand(lora.as_float32(theta, "F32"), coef[start // 327 :], basis,
                               np.float32(0.7), start)  # fmt: skip
        assert got == want.tobytes()


def test_the_fma_check_covers_the_functions_the_kernel_calls():
    """`fma_instructions` checks every helper the kernel calls: in the kernel's cached object
    code, where each is linked in under its own symbol, or compiled here with the kernel
    (then with a signature of its own): none is left unchecked."""
    rng = np.random.default_rng(1)
    coef = rng.standard_normal((9, 3)).astype(np.float32)
    basis = rng.standard_normal((3, 80)).astype(np.float32)
    theta = _stored(rng.standard_normal(9 * 80), "BF16")[2:]
    lora.values(theta, "BF16", coef, basis, np.float32(1), 1, "BF16", np.empty(9 * 320, np.uint8))
    assert lora_numba.fma_instructions() == []
    kernel = lora_numba.lora_values
    for sig, compiled in kernel.overloads.items():
        if not compiled.library._disable_inspection:  # compiled here
            assert all(helper.signatures for helper in lora_numba.HELPERS)
            continue
        listing = fma_check.cached_disassembly(kernel, sig)
        if listing is None and shutil.which("objdump") is None and not os.environ.get("CI"):
            pytest.skip("no objdump (binutils): the helpers were compiled afresh and checked")
        assert listing is not None, "objdump reads the cached object code"
        symbols = [line for line in listing.splitlines() if line.endswith(">:")]
        for helper in lora_numba.HELPERS:  # numba's mangling: ...10lora_numba7_block4B...
            name = f"lora_numba{len(helper.__name__)}{helper.__name__}B"
            assert any(name in s for s in symbols), helper.__name__


@pytest.fixture
def on_torch():
    """This process's LoRA products computed with torch (on the CPU), as a GPU worker's
    are (`lora.compute_on`), for the test's length."""
    lora.compute_on("cpu")
    try:
        yield
    finally:
        lora.compute_on(None)


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize(("start", "stop"), [(0, 9 * 300), (299, 2401), (601, 899)])
def test_torch_on_a_device_gives_the_kernels_bytes(dtype, start, stop):
    """A GPU worker's products (torch, elementwise, k ascending): the numba kernel's bytes,
    into every dtype, over whole and partial rows."""
    rng = np.random.default_rng(21)
    rows, cols, r = 9, 300, 16
    coef = rng.standard_normal((rows, r)).astype(np.float32)
    basis = rng.standard_normal((r, cols)).astype(np.float32)
    isz = np.dtype(NUMPY[dtype]).itemsize
    theta = _stored(rng.standard_normal(rows * cols), dtype)[start * isz : stop * isz]
    args = (theta, dtype, coef[start // cols :], basis, np.float32(1.5), start)
    for out_dtype in ("BF16", "F16", "F32"):
        kernel = lora.values(*args, out_dtype, np.empty((stop - start) * 4, np.uint8)).tobytes()
        lora.compute_on("cpu")
        try:
            torch_got = lora.values(*args, out_dtype, np.empty((stop - start) * 4, np.uint8))
        finally:
            lora.compute_on(None)
        assert torch_got.tobytes() == kernel


def test_torch_keeps_the_order_and_two_roundings(on_torch):
    """On the torch path too: k ascending (`(2**24 + 1) - 2**24` is 0), and `acc + a * a`
    rounded twice (an FMA would give another value), and a quantized base decoded first."""
    from ram_dist.kernels import fp8

    one = np.array([[1.0, 1.0, 1.0]], np.float32)
    big = np.array([[2.0**24], [1.0], [-(2.0**24)]], np.float32)
    zero = np.zeros(1, np.float32).view(np.uint8)
    out = lora.values(zero, "F32", one, big, np.float32(1), 0, "F32", np.empty(4, np.uint8))
    assert out.view(np.float32)[0] == 0.0
    a = np.float32(1 + 2**-12)
    coef, basis = np.array([[1, a]], np.float32), np.array([[-1], [a]], np.float32)
    out = lora.values(zero, "F32", coef, basis, np.float32(1), 0, "F32", np.empty(4, np.uint8))
    assert out.view(np.float32)[0] == 2**-11
    codes = np.random.default_rng(2).integers(0, 0x7E, 16).astype(np.uint8)
    base = fp8.Fp8Values(codes, np.full(1, 0.5, np.float32), 4, (4, 4))
    factors = np.full((4, 2), 0.25, np.float32), np.full((2, 4), 0.5, np.float32)
    got = lora.values(base, "F32", *factors, np.float32(3), 0, "BF16", np.empty(64, np.uint8))
    lora.compute_on(None)
    want = lora.values(base, "F32", *factors, np.float32(3), 0, "BF16", np.empty(64, np.uint8))
    assert got.tobytes() == want.tobytes()
