"""The fused kernel of the consensus members (`consensus_ta`, `consensus_ties`: TALL masks,
`tall_numba`) gives exactly the eager torch path's bytes.

The method object runs both ways, rounds then map pass chunk by chunk (`kernel_runs.run`):
`merge_chunk(...).to(out_dtype)` with kernels off, `fused_merge` with them on, over RL-like
sparse task vectors and over a pool of dyadic values (so that `|delta_t|` equals
`lambda_t * |mixed - delta_t|` at many elements, signed zeros in the base and the tasks, a
dropped negative `mixed` gives -0.0, and TIES's cut splits equal magnitudes); every k from 1
to the task count, several lambdas (0, 1, one not a float32, one above 1), densities and
weights, with and without normalize and L1 rescaling, mixed input dtypes, every output
dtype, chunks cut across the kernel's tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, sparse_inputs  # noqa: E402

from ram_dist.kernels import primitives, ram_numba, tall_numba  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402
from ram_dist.methods.protocol import Chunk, ChunkWork  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TILE = primitives.TILE
W = [0.7, -0.35, 1.25, 0.5]


def pool_inputs(n: int, dtypes: tuple[torch.dtype, ...], seed: int):
    """A base and tasks from a pool of dyadic values and signed zeros: sums and differences
    are exact, so masks often sit exactly at their threshold, and magnitudes repeat."""
    pool = torch.tensor([0.0, -0.0, 0.25, -0.25, 0.5, -0.5, 1.0, -1.0, 0.75, -2.0])
    g = torch.Generator().manual_seed(seed)
    pick = lambda: pool[torch.randint(0, len(pool), (n,), generator=g)]  # noqa: E731
    base = pick().to(dtypes[0])
    tasks = [torch.where(torch.rand(n, generator=g) < 0.6, base.float() + pick(), base.float())
             .to(d) for d in dtypes[1:]]  # fmt: skip
    return base, tasks


def params(method: str, n: int, k: int, lambdas: list[float], **kw) -> dict:
    """Every parameter the method is handed: mergekitty's defaults unless given."""
    out = {p.name: [p.default] * n if p.per_task else p.default
           for p in get_method(method).parameters if p.passed}  # fmt: skip
    out.update(weight=W[:n], k=[k] * n, **{"lambda": lambdas[:n]})
    return out | kw


def assert_same(method: str, p: dict, base, tasks, bounds, out_dtype) -> torch.Tensor:
    """Fused and eager bytes equal (and the fused path took every chunk); the eager result."""
    got, _, _ = run(method, p, base, tasks, bounds, True, out_dtype)
    want, _, _ = run(method, p, base, tasks, bounds, False, out_dtype)
    a, b = got.view(torch.uint8).numpy(), want.view(torch.uint8).numpy()
    diff = np.flatnonzero((a != b).reshape(-1, got.element_size()).any(axis=1))
    assert diff.size == 0, (method, p, diff[:5], got[diff[:5]], want[diff[:5]])
    return want


LAMBDAS = [[1.0, 1.0, 1.0, 1.0], [0.3, 2.5, 0.0, 1.0], [0.5, 1.0, 2.0, 0.1]]


@pytest.mark.parametrize("method", ["consensus_ta", "consensus_ties"])
@pytest.mark.parametrize("inputs", [sparse_inputs, pool_inputs])
@pytest.mark.parametrize("normalize", [False, True])
def test_every_k_and_lambda_fused_equals_eager(method, inputs, normalize) -> None:
    dtypes = (BF16, BF16, F16, F32, BF16)
    n = TILE + 999
    base, tasks = inputs(n, dtypes, seed=4)
    density = [1.0] * 4 if method == "consensus_ta" else [0.5, 0.3, 1.0, 0.7]
    for k in range(1, 5):
        for lambdas in LAMBDAS:
            p = params(method, 4, k, lambdas, density=density, normalize=normalize)
            assert_same(method, p, base, tasks, [0, 5, TILE + 1, n], BF16)


@pytest.mark.parametrize("method", ["consensus_ta", "consensus_ties"])
@pytest.mark.parametrize("dtypes", [(BF16, BF16, BF16), (F32, BF16, F16, F32), (F16, F16, F16)])
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
def test_dtypes_fused_equal_eager(method, dtypes, out_dtype) -> None:
    n = 2 * TILE + 37
    for inputs in (sparse_inputs, pool_inputs):
        base, tasks = inputs(n, dtypes, seed=len(dtypes))
        m = len(tasks)
        density = [1.0] * m if method == "consensus_ta" else [0.4, 0.8, 0.6][:m]
        p = params(method, m, 2, [0.8, 1.5, 1.0], density=density)
        assert_same(method, p, base, tasks, [0, 1000, 1001, 2600, n], out_dtype)


def test_the_edges_occur_and_match() -> None:
    """On the pool, in float32: some masks sit exactly at their threshold (strict `>` drops
    them), some output is a -0.0 (a -0.0 base plus a dropped negative mixed), and TIES's cut
    splits equal magnitudes (the flat-index rounds ran); fused equals eager there."""
    from ram_dist.methods.generalized_task_arithmetic import combine

    n = 70001
    base, tasks = pool_inputs(n, (F32, F32, F32, F32), seed=7)
    p = params("consensus_ties", 3, 2, [1.0, 0.5, 2.0], density=[0.3, 0.45, 0.62])
    got, state, _ = run("consensus_ties", p, base, tasks, [0, 40000, 40001, n], True, F32)
    assert any("index_cut" in c for c in state["tensors"]["w"]["cuts"])
    want = assert_same("consensus_ties", p, base, tasks, [0, 40000, 40001, n], F32)
    assert bool(((want == 0) & want.signbit()).any())
    _, deltas = combine.task_vectors(base, tasks)
    mixed = combine.mix(deltas, W[:3], consensus=False, normalize=False, lambda_=1.0)
    at = deltas[0].abs() == (mixed - deltas[0]).abs()
    assert bool((at & (deltas[0] != 0)).any())  # ties at the threshold exist on the pool


@pytest.mark.parametrize("density", [[0.5, 0.3, 0.7], [1e-6, 0.99, 1.0]])
def test_l1_rescale_fused_equals_eager(density) -> None:
    """With `rescale` the L1 rounds stay eager (`fused_statistics` declines, `fuses` says
    so), but the map pass's kernel scales each cut task by its factor as mergekitty does."""
    n = TILE + 77
    base, tasks = sparse_inputs(n, (BF16, BF16, F16, F32), seed=2)
    p = params("consensus_ties", 3, 2, [1.0, 0.5, 2.0], density=density, rescale=True)
    method = get_method("consensus_ties")
    assert not method.fuses(p) and method.fuses(p | {"rescale": False})
    _, state, _ = run("consensus_ties", p, base, tasks, [0, n], False, F32)
    assert any(c and c.get("factor") not in (None, 1.0) for c in state["tensors"]["w"]["cuts"])
    work = ChunkWork(Chunk("w", 0, (n,)), p, state, 0)
    assert method.fused_statistics(work, [base, *tasks]) is None
    for out_dtype in (BF16, F32):
        assert_same("consensus_ties", p, base, tasks, [0, 3, n], out_dtype)


def test_no_fma_in_the_compiled_tall_kernel() -> None:
    """No FMA in the kernel's code, for every signature this process has used
    (`fma_check.fma_findings`)."""
    base, tasks = sparse_inputs(100, (BF16, F16, F32), seed=1)
    out = torch.empty(100, dtype=BF16)
    tall_numba.merge(base, tasks, out, weights=[0.5, 0.25], cuts=[(0, -1), tall_numba.NO_CUT],
                     factors=[1.5, None], lambdas=[0.5, 1.0], k=1, start=0, consensus=True,
                     normalize=True, divisor=1.0)  # fmt: skip
    for kernel in tall_numba.KERNELS:
        assert kernel.signatures and ram_numba.fma_findings(kernel) == []
