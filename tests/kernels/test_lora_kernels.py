"""The LoRA product kernel (`kernels.lora`, `kernels.lora_numba`): the spec's fixed order,
step by step in float32 scalars, byte for byte on both paths, with no fused multiply-add."""

from __future__ import annotations

import numpy as np
import pytest
from lora_steps import product_by_hand

from ram_dist.kernels import lora, lora_numba

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


@pytest.mark.parametrize(("start", "stop"), [(0, 9 * 300), (300, 9 * 300), (299, 2401), (601, 899)])
def test_wide_rows_four_at_a_time_and_in_tiles(start, stop):
    """Rows wider than the kernel's tile, whole rows four at a time and partial rows alone:
    the same bytes as the numpy rule (which computes whole rows at once)."""
    rng = np.random.default_rng(11)
    rows, cols, r = 9, 300, 5
    coef = rng.standard_normal((rows, r)).astype(np.float32)
    basis = rng.standard_normal((r, cols)).astype(np.float32)
    theta = _stored(rng.standard_normal(rows * cols), "BF16")[start * 2 : stop * 2]
    got = [
        lora.values(theta, "BF16", coef[start // cols :], basis, np.float32(1.5), start, "BF16",
                    np.empty((stop - start) * 4, np.uint8), fast=fast).tobytes()
        for fast in (True, False)
    ]  # fmt: skip
    assert got[0] == got[1]
