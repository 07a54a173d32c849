"""The base at a task's precision in its three homes, against torch's casts and each other:
`kernels.precision` (numpy), `methods.task_vectors` (torch, the eager rule) and the fused
kernels' `primitives.load_tile_bases`; and the first reduce round's precision check,
`precision.check_counts` (numpy) against `precision_numba.check_counts` (fused), an FP8
base read as stored included.

Values are chosen to hit the casts' edges: ties to even in both 16-bit dtypes, float16
subnormals and values that flush to zero, values past float16's and bfloat16's largest
(overflow to inf), signed zeros."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ram_dist import kernels
from ram_dist.kernels import fp8, precision
from ram_dist.methods import task_vectors as measured

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed")

EPS = 1e-5


def edge_values(n: int = 6000, seed: int = 0) -> np.ndarray:
    """float32 values around the 16-bit dtypes' edges, then random weights."""
    rng = np.random.default_rng(seed)
    edges = np.array(
        [0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 3.0e38, 2.0**-14, 2.0**-24,
         2.0**-25, 2.0**-26, 1e-30, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11,
         1.0 + 3 * 2.0**-11, -(1.0 + 2.0**-8)],
        np.float32,
    )  # fmt: skip
    tail = (rng.standard_normal(n - edges.size) * 0.05).astype(np.float32)
    tail[::7] *= np.float32(1e-4)  # small weights: float16 subnormals
    return np.concatenate([edges, tail])


def as_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(x.copy()).to(dtype)


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor as the engine hands it to the methods (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_rounded_is_torchs_cast(dtype):
    x = edge_values()
    want = as_torch(x, torch.float32).to(getattr(torch, {"BF16": "bfloat16"}.get(dtype, "float16")))
    got = precision.rounded(x, dtype)
    assert np.array_equal(got.view(np.uint32), want.to(torch.float32).numpy().view(np.uint32))
    assert np.isinf(got[3:6]).tolist() == [False, dtype == "F16", dtype == "F16"]


PAIRS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("base_dtype, task_dtype", PAIRS)
def test_torch_and_numpy_rules_give_the_same_vectors_and_values(base_dtype, task_dtype):
    """`task_vectors` and `task_values` in torch and numpy, bit for bit; an unchanged task
    (the base cast to its dtype) has a zero vector wherever the cast is finite, and its
    values are the base's."""
    x = edge_values()
    base = as_torch(x, base_dtype)
    unchanged = base.to(task_dtype)
    moved = unchanged.clone()
    moved[100:200] = (moved[100:200].float() + 0.01).to(task_dtype)
    b, taus = measured.task_vectors(base, [unchanged, moved])
    nb, ntaus = precision.task_vectors([raw(base), raw(unchanged), raw(moved)])
    assert np.array_equal(b.numpy().view(np.uint32), nb.view(np.uint32))
    for tau, ntau in zip(taus, ntaus, strict=True):
        assert np.array_equal(tau.numpy().view(np.uint32), ntau.view(np.uint32))
    finite = torch.isfinite(base.to(task_dtype).float())
    assert (taus[0][finite] == 0).all()
    assert (taus[1][100:200] != 0).any()
    _, values = measured.task_values(base, [unchanged])
    _, nvalues = precision.task_values([raw(base), raw(unchanged)])
    assert np.array_equal(values[0].numpy().view(np.uint32), nvalues[0].view(np.uint32))
    same = finite & (base.float() != 0)  # x_B + 0 is x_B (a -0 base gives +0)
    assert torch.equal(values[0][same], base.float()[same])


def test_only_bf16_and_f16_tasks_of_another_dtype_narrow():
    narrows = precision.narrows
    assert narrows("F32", "BF16") and narrows("F32", "F16") and narrows("BF16", "F16")
    assert narrows("F16", "BF16") and narrows("F64", "BF16")
    assert not narrows("BF16", "BF16") and not narrows("BF16", "F32")
    assert not narrows("F32", "F64") and not narrows("F64", "F32")


def test_the_fused_ram_kernels_measure_against_the_base_at_each_precision():
    """RAM's fused counts on a float32 base with a bf16 task that is the base cast (no
    change), an fp16 one that is too, and a float32 one: only real changes count."""
    from ram_dist.kernels import ram_numba

    x = edge_values()
    x[3:7] = 0.5  # no overflow here: that is refused before a merge
    base = as_torch(x, torch.float32)
    tasks = [base.to(torch.bfloat16), base.to(torch.float16), base.clone()]
    tasks[2][10:20] += 0.25
    hist = ram_numba.overlap_counts(base, tasks, EPS)
    assert [int(hist[t, 1:].sum()) for t in range(3)] == [0, 0, 10]


def fp8_base(rows: int = 64, cols: int = 48, block=(16, 16), seed: int = 1):
    """A random FP8 base as stored (`fp8.Fp8Values`) and its float32 values."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, rows * cols, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x10  # no NaN codes
    per = -(-rows // block[0]) * -(-cols // block[1])
    scales = (rng.random(per) * 1e-3 + 1e-4).astype(np.float32)
    stored = fp8.Fp8Values(q, scales, cols, block)
    values = fp8.dequantize(q, scales, cols, block, np.empty(q.size, np.float32), fast=False)
    return stored, values


def test_the_check_counts_rounding_and_overflow_fused_as_in_numpy():
    """`check_counts`, numpy and fused, on a float32 base: a bf16 agent that is the base
    cast (no change at all), a float32 agent through a float16 round trip with real changes
    (its changes mostly rounding), a float16 agent (the base's overflows counted)."""
    from ram_dist.kernels import precision_numba

    x = edge_values()
    base = as_torch(x, torch.float32)
    cast = base.to(torch.bfloat16)
    trip = base.to(torch.float16).to(torch.float32)
    trip[200:260] += 0.02
    half = base.to(torch.float16)
    inputs = [raw(base), raw(cast), raw(trip), raw(half)]
    want = precision.check_counts(inputs, EPS)
    assert np.array_equal(precision_numba.check_counts(inputs, EPS), want)
    assert want[0].tolist() == [0, 0, 0]
    changed, rounding, overflow = want[1]
    assert changed > 1000 and rounding > 0.9 * changed and overflow == 0
    assert changed - rounding >= 60 - 2  # the real changes are not rounding
    overflows = int(((np.abs(x) >= 65520) & np.isfinite(x)).sum())
    assert want[2, precision.OVERFLOW] == overflows > 0


def test_the_fused_check_reads_an_fp8_base_as_stored():
    """The FP8 base read as stored gives the decoded float32 values' counts: a bf16 agent
    loaded as transformers loads it (the values cast) changes nothing."""
    from ram_dist.kernels import precision_numba

    stored, values = fp8_base()
    agent = torch.from_numpy(values.copy()).to(torch.bfloat16)
    moved = agent.clone()
    moved[5:25] = (moved[5:25].float() * 2 + 0.01).to(torch.bfloat16)
    from_stored = precision_numba.check_counts([stored, raw(agent), raw(moved)], EPS)
    from_values = precision.check_counts([values, raw(agent), raw(moved)], EPS)
    assert np.array_equal(from_stored, from_values)
    assert from_values[:, precision.CHANGED].tolist() == [0, 20]


def test_rams_count_kernel_checks_in_the_same_sweep():
    """RAM's first round counts the precision check from the tiles it loaded: the same
    counts as the check's own kernel, on an FP8 base as stored and on a float32 base."""
    from ram_dist.kernels import precision_numba, ram_numba

    stored, values = fp8_base()
    agent = torch.from_numpy(values.copy()).to(torch.bfloat16)
    trip = torch.from_numpy(values.copy()).to(torch.float16).to(torch.float32)
    trip[7:19] += 0.5
    for base in (stored, values):
        tasks = [raw(agent), raw(trip)]
        hist, nonfinite, checks = ram_numba.overlap_counts_checked(base, tasks, EPS)
        assert np.array_equal(checks, precision_numba.check_counts([base, *tasks], EPS))
        assert np.array_equal(hist, ram_numba.overlap_counts(base, tasks, EPS))
        assert nonfinite == [0, 0, 0] and checks[1, precision.ROUNDING] > 0


def test_no_fma_in_the_check_kernel():
    """No fused multiply-add in the code this process runs (`fma_check.fma_findings`)."""
    from ram_dist.kernels import fma_check, precision_numba
    from ram_dist.kernels.views import kernel_inputs

    stored, values = fp8_base()
    arrays = kernel_inputs(stored, [raw(torch.from_numpy(values).to(torch.bfloat16)), values])
    kernel = precision_numba._check_kernel
    kernel(arrays, np.float32(EPS), np.zeros((2, 3), np.int64))
    assert kernel.signatures and fma_check.fma_findings(kernel) == []
