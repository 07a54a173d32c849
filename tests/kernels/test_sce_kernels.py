"""sce's fused map pass (`sce_numba.merge`, its `fused_merge`) gives the eager rule's bytes
(`merge_chunk` cast to the output dtype): without selection, with the variance cut (its
flat-index rounds too, where the cut splits equal variances), with nothing selected; every
stored dtype (mixed ones measured against the base at each task's precision), every output
dtype, chunks of several sizes around the kernels' tile; and no fused multiply-add."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, sparse_inputs  # noqa: E402

from ram_dist.kernels import fma_check, primitives, sce_numba  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TILE = primitives.TILE
DTYPE_SETS = [(BF16, BF16, BF16, BF16), (F32, BF16, F16, F32), (F16, F16, F16)]


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).numpy()


def pooled(n: int, dtypes: tuple[torch.dtype, ...], seed: int):
    """Values from a small pool (many equal variances, signed zeros, subnormals, sums that
    overflow the 16-bit dtypes), each dtype's largest finite value in place of 3e38. No
    infinity: an inf makes every weight NaN (a NaN mean of squares), and which of two NaNs'
    payloads an operation keeps is the compiled code's choice."""
    pool = torch.tensor([0.0, -0.0, 0.25, -0.25, 0.5, -0.75, 1e-40, 6e4, -6e4, 3e38, 1.0])
    g = torch.Generator().manual_seed(seed)

    def pick(dtype: torch.dtype) -> torch.Tensor:
        big = torch.finfo(dtype).max
        return pool[torch.randint(0, len(pool), (n,), generator=g)].clamp(-big, big)

    base = pick(dtypes[0]).to(dtypes[0])
    tasks = [torch.where(torch.rand(n, generator=g) < 0.5, pick(d), base.float()).to(d)
             for d in dtypes[1:]]  # fmt: skip
    return base, tasks


def both(params, base, tasks, bounds, out_dtype):
    fused = run("sce", params, base, tasks, bounds, True, out_dtype, as_stored=True)
    eager = run("sce", params, base, tasks, bounds, False, out_dtype, as_stored=True)
    (got, state_f, _), (want, state_e, _) = fused, eager
    assert state_f == state_e
    diff = np.flatnonzero(bits(got) != bits(want))
    assert np.array_equal(bits(got), bits(want)), (diff[:5], got[:8], want[:8])
    return state_f


@pytest.mark.parametrize("select_topk", [1.0, 0.3])
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32, torch.float64])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_sce_fused_map_is_eager(dtypes, out_dtype, select_topk) -> None:
    n = 2 * TILE + 77
    base, tasks = sparse_inputs(n, dtypes, seed=len(dtypes))
    for bounds in ([0, n], [0, 5, TILE + 3, n]):
        both({"select_topk": select_topk, "int8_mask": False}, base, tasks, bounds, out_dtype)


@pytest.mark.parametrize("select_topk", [1.0, 0.5, 1e-9])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_sce_fused_map_is_eager_on_edge_values(dtypes, select_topk) -> None:
    """0.5 cuts through equal variances (the flat-index rounds run); 1e-9 selects nothing."""
    n = TILE + 300
    base, tasks = pooled(n, dtypes, seed=3)
    params = {"select_topk": select_topk, "int8_mask": False}
    for out_dtype in (BF16, F32):
        state = both(params, base, tasks, [0, 1000, n], out_dtype)
    info = state["tensors"]["w"]
    if select_topk == 0.5:
        assert info.get("index_cut") is not None
    if select_topk == 1e-9:
        assert info["k"] == 0


def test_fuses_says_where_the_rounds_run_fused() -> None:
    """Every round runs fused, the variance selection's too (`sce_numba.statistics`)."""
    method = get_method("sce")
    assert method.fuses({"select_topk": 1.0, "int8_mask": False})
    assert method.fuses({"select_topk": 0.3, "int8_mask": False})


def test_no_fma_in_the_sce_kernel() -> None:
    """No FMA in the code of any signature this process used (`fma_check.fma_findings`)."""
    x = np.ones(64, np.float32)
    out = np.empty(64, np.float32)
    sce_numba.merge(x, [x, x], out, weights=[0.5, 0.5], select=sce_numba.SELECT_CUT, threshold=3)
    sce_numba.statistics(x, [x, x], sce_numba.SQUARES, threshold=3)
    for kernel in sce_numba.KERNELS:
        assert kernel.signatures and fma_check.fma_findings(kernel) == [], kernel
