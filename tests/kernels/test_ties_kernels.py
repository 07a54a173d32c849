"""The fused TIES / task-arithmetic kernels give exactly the eager torch path's bytes.

The method object runs both ways: `chunk_statistics` and `merge_chunk(...).to(out_dtype)`
with kernels off, and fused (`fused_statistics` by `ties_numba.statistics`, `fused_merge`
by `ties_numba.merge`), over RL-like sparse task vectors, pools of edge values
(signed zeros, subnormals, values whose sums overflow bf16 and fp16, many equal magnitudes
so that the cut needs the flat-index rounds), every supported input and output dtype, mixed,
several chunkings and lengths around the kernels' tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, sparse_inputs, ties_params  # noqa: E402

from ram_dist import kernels  # noqa: E402
from ram_dist.kernels import ram_numba, ties_numba  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402
from ram_dist.methods.protocol import Chunk, ChunkWork  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TILE = ram_numba.TILE


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).numpy()


def edge_inputs(n: int, dtypes: tuple[torch.dtype, ...], seed: int):
    """Values from a small pool: many equal magnitudes, signed zeros, subnormals, and
    magnitudes whose weighted sums overflow the 16-bit output dtypes."""
    pool = torch.tensor(
        [0.0, -0.0, 0.25, -0.25, 0.5, -0.75, 1e-40, -3e-39, 6e4, -6e4, 3e38, 1.0, -1.0]
    )
    g = torch.Generator().manual_seed(seed)
    pick = lambda: pool[torch.randint(0, len(pool), (n,), generator=g)]  # noqa: E731
    base = pick().to(dtypes[0])
    tasks = [torch.where(torch.rand(n, generator=g) < 0.5, pick(), base.float()).to(d)
             for d in dtypes[1:]]  # fmt: skip
    return base, tasks


def assert_same(fused, eager) -> None:
    (got, state_f, totals_f), (want, state_e, totals_e) = fused, eager
    assert state_f == state_e
    for a, b in zip(totals_f, totals_e, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    diff = np.flatnonzero(bits(got).reshape(-1, got.element_size()).any(axis=1) != 0)
    assert np.array_equal(bits(got), bits(want)), (diff[:5], got[:8], want[:8])


DTYPE_SETS = [(BF16, BF16, BF16, BF16), (F32, BF16, F16, F32), (F16, F16, F16)]


@pytest.mark.parametrize("dtypes", DTYPE_SETS)
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
@pytest.mark.parametrize("inputs", [sparse_inputs, edge_inputs])
def test_ties_fused_equals_eager(dtypes, out_dtype, inputs) -> None:
    n = 2 * TILE + 37
    base, tasks = inputs(n, dtypes, seed=len(dtypes))
    params = ties_params(len(tasks))
    for bounds in ([0, n], [0, 5, TILE + 1, n], [0, 1000, 1001, 2600, n]):
        fused = run("ties", params, base, tasks, bounds, True, out_dtype)
        assert_same(fused, run("ties", params, base, tasks, bounds, False, out_dtype))


def test_ties_flat_index_rounds_fused_equal_eager() -> None:
    """Equal non-zero magnitudes straddle the cut: rounds 2 and 3 run on both paths, over a
    tensor spanning several 65536-element index bins."""
    n = 3 * 65536 + 11
    base, tasks = edge_inputs(n, (BF16, BF16, F32, F16), seed=9)
    params = ties_params(3, density=[0.3, 0.45, 0.62], normalize=False, **{"lambda": 0.9})
    bounds = [0, 70000, 70001, 140000, n]
    fused = run("ties", params, base, tasks, bounds, True, BF16)
    assert sum(1 for c in fused[1]["tensors"]["w"]["cuts"] if "index_cut" in c) >= 2
    assert_same(fused, run("ties", params, base, tasks, bounds, False, BF16))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lam", [1.0, 0.8])
@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.8], [0.5, -0.5, 0.0]])
def test_task_arithmetic_fused_equals_eager(normalize, lam, weights) -> None:
    n = TILE + 999
    for inputs in (sparse_inputs, edge_inputs):
        base, tasks = inputs(n, (BF16, BF16, F16, F32), seed=3)
        params = {"weight": weights, "density": [1.0] * 3, "normalize": normalize, "lambda": lam}
        for out_dtype in (BF16, F32):
            fused = run("task_arithmetic", params, base, tasks, [0, 17, n], True, out_dtype)
            eager = run("task_arithmetic", params, base, tasks, [0, 17, n], False, out_dtype)
            assert_same(fused, eager)


def test_density_edges_and_consensus_fused_equal_eager() -> None:
    """Density 1 (untouched), density 0 (all dropped) and a single kept element."""
    base, tasks = sparse_inputs(5000, (F32, F32, F32, F32), seed=11)
    params = ties_params(3, density=[1.0, 0.0, 1e-6])
    for out_dtype in (F32, BF16):
        fused = run("ties", params, base, tasks, [0, 2500, 5000], True, out_dtype)
        assert_same(fused, run("ties", params, base, tasks, [0, 2500, 5000], False, out_dtype))


def test_fused_declines_what_it_does_not_compute() -> None:
    """TIES's L1 rescaling stays on the eager path (`fused_merge` says False; DARE's has
    kernels of its own, test_dare_kernels); float64 inputs never reach it (the engine asks
    the kernels first)."""
    base, tasks = sparse_inputs(100, (F32, F32, F32), seed=1)
    out = torch.empty(100, dtype=F32)
    chunk = Chunk("w", 0, (100,))
    assert not kernels.handle(["F64", "F32"]) and kernels.handle(["F32", "BF16"], "F64")
    params = ties_params(2, rescale=True, density=[0.5, 0.5])
    _, state, _ = run("ties", params, base, tasks, [0, 100], False, F32)
    ties = get_method("ties")
    assert not ties.fused_merge(ChunkWork(chunk, params, state), [base, *tasks], out)
    assert ties.fused_statistics(ChunkWork(chunk, params, state), [base, *tasks]) is None


def test_no_fma_in_compiled_ties_kernels() -> None:
    """No FMA in the kernels' code, for every signature this process has used (the other
    tests of this module ran first; `fma_check.fma_findings`)."""
    base, tasks = sparse_inputs(100, (BF16, F16, F32), seed=1)
    ties_numba.statistics(base, tasks, ties_numba.HIGH, 1 << 15)
    out = torch.empty(100, dtype=BF16)
    ties_numba.merge(base, tasks, out, weights=[0.5, 0.25], keep=[2, 0], cuts=[(0, -1)] * 2,
                     start=0, consensus=True, normalize=True, divisor=1.0, lambda_=0.5)  # fmt: skip
    for kernel in ties_numba.KERNELS:
        assert kernel.signatures and ram_numba.fma_findings(kernel) == []
