"""arcee_fusion's fused KL and map pass (`arcee_numba`, its `fused_statistics` and
`fused_merge`) give the eager rule's integers and bytes: the float64 exp and log bit for bit
`float64_math`'s on ordinary and special values, both rounds' histograms and the merged
bytes on rows shorter and longer than the kernels' tile, of lengths that are and are not
powers of two, chunked by rows, every stored dtype (a mixed one measured against the base at
the model's precision) and output dtype; and no fused multiply-add in the compiled kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, stored  # noqa: E402
from numba import njit  # noqa: E402

from ram_dist.kernels import arcee_numba, fma_check  # noqa: E402
from ram_dist.methods import arcee_fusion, float64_math, get_method  # noqa: E402
from ram_dist.methods.protocol import (
    Chunk,  # noqa: E402
    ChunkWork,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).numpy()


@njit(cache=False)
def _exps(xs, out):  # noqa: ANN001, ANN202
    for i in range(xs.size):
        out[i] = arcee_numba.exp64(xs[i])


@njit(cache=False)
def _logs(xs, out):  # noqa: ANN001, ANN202
    for i in range(xs.size):
        out[i] = arcee_numba.log64(xs[i])


def test_the_constants_are_float64_math_s():
    assert arcee_numba.LN2_HI == float64_math._LN2_HI
    assert arcee_numba.LN2_LO == float64_math._LN2_LO
    assert arcee_numba.INV_LN2 == float64_math._INV_LN2
    assert (arcee_numba.EXP_TERMS, arcee_numba.LOG_TERMS) == (
        float64_math._EXP_TERMS, float64_math._LOG_TERMS,
    )  # fmt: skip
    assert (arcee_numba.EXP_MAX, arcee_numba.EXP_MIN) == (
        float64_math._EXP_MAX, float64_math._EXP_MIN,
    )  # fmt: skip
    assert arcee_numba.SQRT2 == float64_math._SQRT2
    assert list(arcee_numba.INVERSE) == float64_math._INVERSE
    assert arcee_numba.EPS == arcee_fusion.EPS


def _ties() -> list[float]:
    """Arguments whose `x / ln 2`, as exp computes it, is an integer plus a half: its
    rounding is to even, whichever way the kernel rounds (`np.rint`, or `ROUNDER`'s sum)."""
    found = []
    for k in (-1000.5, -3.5, -2.5, -0.5, 0.5, 1.5, 2.5, 101.5, 1022.5):
        c = k / float64_math._INV_LN2
        for _ in range(64):
            product = c * float64_math._INV_LN2
            if product == k:
                found.append(c)
                break
            c = np.nextafter(c, np.inf if product < k else -np.inf)
    assert len(found) >= 5, found
    return found


def test_exp_and_log_are_float64_math_s_bits():
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, 2.0**-1022, 1e308, -1e-310, 1.0]
    wide = rng.uniform(-760, 720, 20000)
    near = rng.uniform(-1, 1, 20000)
    xs = np.concatenate([special, wide, near, [709.78, 709.79, -745.13, -745.14], _ties()])
    got = np.empty_like(xs)
    _exps(xs, got)
    want = float64_math.exp(torch.from_numpy(xs)).numpy()
    assert np.array_equal(got.view(np.int64), want.view(np.int64))
    positive = np.exp(rng.uniform(-740, 709, 20000))
    ys = np.concatenate([special, positive, rng.uniform(0.5, 2, 20000), [-1.0, 1e-320]])
    _logs(ys, got := np.empty_like(ys))
    want = float64_math.log(torch.from_numpy(ys)).numpy()
    assert np.array_equal(got.view(np.int64), want.view(np.int64))


def test_histograms_count_the_order_keys():
    """Both rounds' counts, against `order_keys` and torch's bincount, on every kind of
    float32: signed zeros and infinities, subnormals, NaNs of both signs, ties."""
    rng = np.random.default_rng(1)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1.0, 1.0],
                       np.float32)  # fmt: skip
    imp = np.concatenate([special, rng.standard_normal(5000).astype(np.float32)])
    keys = arcee_fusion.order_keys(torch.from_numpy(imp))
    want = torch.bincount(keys >> 16, minlength=1 << 16)
    assert np.array_equal(arcee_numba.histogram(imp, []), want.numpy())
    high = [int(keys[0]) >> 16, int(keys[4]) >> 16, int(keys[12]) >> 16]
    got = arcee_numba.histogram(imp, high)
    for t, b in enumerate(high):
        inside = keys[(keys >> 16) == b] & 0xFFFF
        assert np.array_equal(got[t], torch.bincount(inside, minlength=1 << 16).numpy())


def _inputs(rows: int, length: int, dtypes: tuple[torch.dtype, torch.dtype], seed: int):
    """A base and a model that moved it by 0.1 N(0, 1) in about half the elements, with a
    signed zero and ties of importance (equal rows)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows * length, generator=g)
    moved = torch.rand(rows * length, generator=g) < 0.5
    task = base + torch.where(moved, 0.1 * torch.randn(rows * length, generator=g), 0.0)
    if rows > 2:
        base[length : 2 * length] = base[:length]
        task[length : 2 * length] = task[:length]
    task[0] = -0.0
    return base.to(dtypes[0]), [task.to(dtypes[1])]


def both(base, tasks, shape, rows, out_dtype):
    length = shape[-1]
    bounds = [r * length for r in rows]
    args = (base, tasks, bounds)
    fused = run("arcee_fusion", {}, *args, True, out_dtype, as_stored=True, shape=shape)
    eager = run("arcee_fusion", {}, *args, False, out_dtype, as_stored=True, shape=shape)
    (got, state_f, totals_f), (want, state_e, totals_e) = fused, eager
    assert state_f == state_e
    for a, b in zip(totals_f, totals_e, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    diff = np.flatnonzero(bits(got) != bits(want))
    assert np.array_equal(bits(got), bits(want)), (diff[:5], got[:8], want[:8])
    return state_f


@pytest.mark.parametrize("dtypes", [(BF16, BF16), (F32, BF16), (F16, F16), (F32, F32)])
@pytest.mark.parametrize(("shape", "rows"), [
    ((40, 37), [0, 1, 17, 40]), ((3, 5000), [0, 2, 3]), ((2, 4096), [0, 2]), ((9, 1), [0, 4, 9]),
])  # fmt: skip
def test_arcee_fused_rounds_and_map_are_eager(dtypes, shape, rows) -> None:
    base, tasks = _inputs(shape[0], shape[1], dtypes, seed=shape[1])
    for out_dtype in (BF16, F32):
        state = both(base, tasks, shape, rows, out_dtype)
    assert len(state["tensors"]["w"]["quartiles"]) == 3


@pytest.mark.parametrize("out_dtype", [F16, torch.float64])
def test_arcee_fused_on_infinities_and_other_outputs(out_dtype) -> None:
    """A row with an infinite model value (its KL and importances NaN) and one whose model
    is the base (importance 0)."""
    base, (task,) = _inputs(12, 50, (F32, F32), seed=1)
    task[5 * 50 + 3] = float("inf")
    task[7 * 50 : 8 * 50] = base[7 * 50 : 8 * 50]
    both(base, [task], (12, 50), [0, 6, 12], out_dtype)


def test_fuses_and_declines_an_empty_tensor() -> None:
    method = get_method("arcee_fusion")
    assert method.fuses({})
    x = np.zeros(0, np.float32)
    state = method.initial_state({"w": {}}, {"w": 0}, 1)
    assert not method.fused_merge(ChunkWork(Chunk("w", 0, (0, 4)), {}, state), [x, x], x)
    with pytest.raises(ValueError, match="whole rows"):
        arcee_numba.importance(*stored([torch.zeros(10), torch.zeros(10)]), 4)


def test_no_fma_in_the_arcee_kernels() -> None:
    """No FMA in the code of any signature this process used (`fma_check.fma_findings`)."""
    x = np.ones(64, np.float32)
    out = np.empty(64, np.float32)
    imp = arcee_numba.importance(x, x, 8)
    arcee_numba.merge(x, x, imp, 0.5, out)
    arcee_numba.histogram(imp, [3])
    for kernel in arcee_numba.KERNELS:
        assert kernel.signatures and fma_check.fma_findings(kernel) == [], kernel
