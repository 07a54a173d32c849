"""The fused DELLA kernels give exactly the eager torch path's bytes: the L1 round's
statistics and the merge, through the method object (`fused_statistics`, `fused_merge`
against `chunk_statistics`, `merge_chunk(...).to(out_dtype)`), over RL-like sparse task
vectors and pools of edge values (equal magnitudes, signed zeros, subnormals, overflow),
1-D, 2-D, 3-D and one-column tensors, a task whose only infinity or NaN is dropped, mixed
input and every output dtype; their ranks by
counting are a stable sort's. breadcrumbs' rounds by TIES's histogram kernel give the eager
rounds' statistics, and its map pass by TIES's merge kernel the eager bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import della_params, run, run_rows  # noqa: E402
from numba import njit  # noqa: E402

from ram_dist.kernels import della_numba, primitives, ram_numba  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402
from ram_dist.methods.protocol import (
    Chunk,  # noqa: E402
    ChunkWork,
    RoundTotals,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def inputs(shape, dtypes, seed: int, edges: bool):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    if edges:
        pool = torch.tensor([0.0, -0.0, 0.25, -0.25, 0.5, -0.75, 1e-40, -3e-39, 6e4, -6e4, 1.0])
        pick = lambda: pool[torch.randint(0, len(pool), (n,), generator=g)]  # noqa: E731
        base = pick()
        tasks = [torch.where(torch.rand(n, generator=g) < 0.5, pick(), base) for _ in dtypes[1:]]
    else:
        base = torch.randn(n, generator=g) * 0.02
        step = lambda: 1e-3 * torch.randn(n, generator=g)  # noqa: E731
        tasks = [
            base + torch.where(torch.rand(n, generator=g) < p, step(), 0)
            for p in (0.46, 0.03, 0.54)[: len(dtypes) - 1]
        ]
    return base.to(dtypes[0]), [t.to(d) for t, d in zip(tasks, dtypes[1:], strict=True)]


CASES = [
    ("della", (40, 37), [0, 1, 17, 40], (F32, F32, F32, F32), F32, {}),
    ("della", (40, 37), [0, 40], (BF16, BF16, F16, F32), BF16, {"lambda": 0.7}),
    ("della_linear", (300,), [0, 1], (F32, F32, F32), F16, {"normalize": True}),
    ("della_linear", (5, 6, 7), [0, 2, 5], (F16, BF16, F32), F32, {"rescale": False}),
    ("della", (9, 1), [0, 4, 9], (F32, F32, F32), F32, {}),
]


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize(("method", "shape", "rows", "dtypes", "out_dtype", "kw"), CASES)
def test_fused_is_eager(method, shape, rows, dtypes, out_dtype, kw, edges) -> None:
    base, tasks = inputs(shape, dtypes, seed=len(rows), edges=edges)
    params = della_params(len(tasks), **kw)
    fused = run_rows(method, params, base, tasks, shape, rows, True, out_dtype)
    eager = run_rows(method, params, base, tasks, shape, rows, False, out_dtype)
    assert fused[1] == eager[1]
    assert fused[2].keys() == eager[2].keys()
    assert all(torch.equal(fused[2][k], eager[2][k]) for k in fused[2])
    got, want = fused[0], eager[0]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_density_one_takes_chunks_of_any_length() -> None:
    """Nothing sampled (not `whole_rows`): chunks cut inside rows, an empty one included."""
    base, tasks = inputs((10, 7), (F32, BF16, F32), seed=3, edges=False)
    params = della_params(2, density=[1.0, 1.0])
    assert not get_method("della").whole_rows(params)
    bounds = [0, 13, 13, 69, 70]
    fused = run_rows("della", params, base, tasks, (10, 7), None, True, BF16, bounds)
    eager = run_rows("della", params, base, tasks, (10, 7), None, False, BF16, bounds)
    assert torch.equal(fused[0].view(torch.uint8), eager[0].view(torch.uint8))


@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_a_dropped_infinity_or_nan_is_nan_in_the_kept_statistic(method, special) -> None:
    """A task whose only non-finite delta is dropped: its kept vector holds `special * 0.0`,
    NaN, so its kept L1 norm and its rescaling factor are NaN, in the eager rule and the
    fused round alike (not the kept norm of the finite values, and an infinite factor)."""
    shape, n = (40, 37), 40 * 37
    seen = 0
    for seed in (23, 26, 31, 37):
        g = torch.Generator().manual_seed(seed)
        base = torch.randn(n, generator=g) * 0.02
        tasks = [
            base
            + torch.where(torch.rand(n, generator=g) < p, 1e-3 * torch.randn(n, generator=g), 0)
            for p in (0.46, 0.03, 0.54)
        ]
        tasks[0][int(torch.randint(0, n, (1,), generator=g))] = special
        params = della_params(3, seed=seed)
        fused = run_rows(method, params, base, tasks, shape, [0, 17, 40], True, F32)
        eager = run_rows(method, params, base, tasks, shape, [0, 17, 40], False, F32)
        assert all(torch.equal(fused[2][k], eager[2][k]) for k in fused[2])
        assert json.dumps(fused[1]) == json.dumps(eager[1])
        assert torch.equal(fused[0].view(torch.uint8), eager[0].view(torch.uint8))
        kept = eager[2]["w"][0, 1]  # task 0's kept statistic: its NaN bin counts a NaN
        seen += int(kept[255]) >= 1 << 32 and np.isnan(eager[1]["tensors"]["w"]["factors"][0])
    assert seen >= 1  # some seed drops the task's only non-finite delta


def test_no_fma_in_compiled_della_kernels() -> None:
    """No FMA in the kernels' code, for every signature this process has used
    (`fma_check.fma_findings`)."""
    base, tasks = inputs((8, 16), (F32, BF16, F16), seed=1, edges=False)
    kw = dict(start=0, groups=(16, 1), stream_keys=[1, None], densities=[0.5, 1.0],
              epsilons=[0.1, 0.1])  # fmt: skip
    della_numba.statistics(base, tasks, **kw)
    out = torch.empty(base.numel(), dtype=BF16)
    della_numba.merge(base, tasks, out, **kw, factors=[1.5, None], weights=[0.5, 0.25],
                      consensus=True, normalize=True, divisor=1.0, lambda_=0.5)  # fmt: skip
    for kernel in della_numba.KERNELS:
        assert kernel.signatures and ram_numba.fma_findings(kernel) == []


@njit(**primitives.OPTIONS)
def _counted_ranks(x, n, inner):  # noqa: ANN001, ANN202  (numba arrays)
    """Each element's ascending rank in its group by `della_numba.ascending` (the kernels'
    gathering of a group's keys, with strides, written again here)."""
    keys, order, swap, counts = della_numba.rank_scratch(n)
    out = np.zeros(x.size, np.int64)
    for lo in range(0, x.size, n * inner):
        for c in range(inner):
            for j in range(n):
                keys[j] = primitives.bits(x[lo + j * inner + c]) & primitives.ABS32
            della_numba.ascending(keys, n, order, swap, counts)
            for p in range(n):
                out[lo + order[p] * inner + c] = p + 1
    return out


def _sorted_ranks(x: np.ndarray, n: int, inner: int) -> np.ndarray:
    """The reference: ranks 1..n ascending by |x| (its float32 bits) from a stable descending
    argsort, so that among equal magnitudes the lowest index ranks highest."""
    keys = (x.view(np.uint32) & 0x7FFFFFFF).astype(np.int64).reshape(-1, n, inner)
    order = np.argsort(-keys, axis=1, kind="stable")
    ranks = np.empty_like(keys)
    np.put_along_axis(ranks, order, np.arange(n, 0, -1).reshape(1, n, 1), axis=1)
    return ranks.reshape(-1)


def _rank_values(kind: str, size: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """float32 task vectors `float32(x_t) - float32(x_B)` of stored `dtype` values, drawn so
    that the counting meets each of its cases."""
    if kind == "pool":  # few magnitudes, both signs, zeros, subnormals, inf, NaN
        pool = torch.tensor([0.0, -0.0, 0.5, -0.5, 0.25, 1e-40, -1e-40, 3.0, float("inf"),
                             float("nan"), -float("inf"), 6e4])  # fmt: skip
        return pool[torch.randint(0, len(pool), (size,), generator=g)].to(dtype).float()
    base = (torch.randn(size, generator=g) * 0.02).to(dtype)
    if kind == "sparse":  # 97 % unchanged: zero deltas
        step = torch.where(torch.rand(size, generator=g) < 0.03, torch.randn(size, generator=g), 0)
    elif kind == "dense":
        step = torch.randn(size, generator=g)
    elif kind == "wide":  # magnitudes across many binades
        step = torch.randn(size, generator=g) * 2 ** torch.randint(-30, 20, (size,), generator=g)
    else:  # "cluster": a narrow cluster and a far outlier: large buckets (byte radix)
        step = 1 + torch.rand(size, generator=g) * 1e-3
        step[torch.randint(0, size, (3,), generator=g)] = 1e4
    task = (base.float() + 1e-3 * step).to(dtype)
    return task.float() - base.float()


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("kind", ["pool", "sparse", "dense", "wide", "cluster"])
@pytest.mark.parametrize(("n", "inner", "groups"), [(1, 1, 3), (2, 1, 5), (37, 1, 4),
                                                     (700, 3, 2), (5000, 1, 2)])  # fmt: skip
def test_counted_ranks_are_the_stable_sort_s(dtype, kind, n, inner, groups) -> None:
    """della's ranks by counting are a stable sort's: ascending |delta|, equal magnitudes
    (many, with `pool` and the 16-bit dtypes) ranked highest at the lowest index."""
    g = torch.Generator().manual_seed(n + inner)
    x = _rank_values(kind, groups * n * inner, dtype, g).numpy()
    assert np.array_equal(_counted_ranks(x, n, inner), _sorted_ranks(x, n, inner))


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("dtypes", [(F32, F32, F32, F32), (BF16, F16, BF16, F32)])
def test_breadcrumbs_fused_statistics_are_eager(dtypes, edges) -> None:
    """Every round, both cuts of every task (equal magnitudes at the cuts with `edges`), a
    task left untouched: the fused statistics, summed, and the state they give are the
    eager ones; the map pass (eager) then gives the same bytes."""
    n = 3000
    base, tasks = inputs((n,), dtypes, seed=5, edges=edges)
    params = {
        "weight": [0.7, -0.35, 1.25], "density": [0.3, 0.5, 1.0], "gamma": [0.1, 0.0, 0.2],
        "normalize": False, "lambda": 1.0, "rescale": False,
    }  # fmt: skip
    method = get_method("breadcrumbs_ties")
    results = []
    for fused in (True, False):
        state = method.initial_state({"w": params}, {"w": n}, len(tasks))
        all_totals = []
        for round_ in range(method.rounds):
            if not method.active(round_, state, "w"):
                continue
            totals: dict[str, torch.Tensor] = {}
            for lo, hi in ((0, 1000), (1000, 1001), (1001, n)):
                chunk, b, ts = Chunk("w", lo, (n,)), base[lo:hi], [t[lo:hi] for t in tasks]
                got = method.fused_statistics(ChunkWork(chunk, params, state, round_), [b, *ts])
                if fused:
                    stats = {k: torch.from_numpy(v) for k, v in got[0].items()}
                else:
                    stats = method.chunk_statistics(ChunkWork(chunk, params, state, round_), b, ts)
                for key, value in stats.items():
                    totals[key] = totals[key] + value if key in totals else value
            all_totals.append(totals)
            state = method.finalize(RoundTotals(round_, totals, {"w": params}, {"w": n}, state))
            state = json.loads(json.dumps(state))
        merged = method.merge_chunk(ChunkWork(Chunk("w", 0, (n,)), params, state), base, tasks)
        results.append((state, all_totals, merged))
    (state_f, totals_f, merged_f), (state_e, totals_e, merged_e) = results
    assert state_f == state_e and len(totals_f) == len(totals_e) >= 2
    assert len(totals_f) == 4 or not edges  # equal magnitudes at the cuts: the index rounds
    for a, b in zip(totals_f, totals_e, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(merged_f.view(torch.int32), merged_e.view(torch.int32))
    with_l1 = {**params, "rescale": True}
    assert method.fuses(params) and not method.fuses(with_l1)
    state = method.initial_state({"w": with_l1}, {"w": n}, len(tasks))
    chunk = Chunk("w", 0, (n,))
    assert method.fused_statistics(ChunkWork(chunk, with_l1, state, 0), [base, *tasks]) is None


BREADCRUMBS_CASES = [
    # (densities, gammas): both cuts, a task untouched (density 1), one with no outliers
    ([0.3, 0.5, 1.0], [0.1, 0.0, 0.2]),
    # top-b is everything (b == n: no lower cut), and nothing kept (a == b: target 0)
    ([0.9, 0.0001, 0.6], [0.1, 0.2, 0.4]),
]


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize(("densities", "gammas"), BREADCRUMBS_CASES)
@pytest.mark.parametrize(
    ("dtypes", "out_dtype"), [((F32, F32, F32, F32), F32), ((BF16, F16, BF16, F32), BF16)]
)
@pytest.mark.parametrize("edges", [False, True])
def test_breadcrumbs_fused_merge_is_eager(method, densities, gammas, dtypes, out_dtype, edges):
    """The map pass by TIES's merge kernel (`KEEP_BETWEEN`) gives the eager rule's bytes,
    rounds fused or eager, at several chunkings (equal magnitudes at the cuts with `edges`:
    the index rounds)."""
    n = 3000
    base, tasks = inputs((n,), dtypes, seed=7, edges=edges)
    params = {
        "weight": [0.7, -0.35, 1.25], "density": densities, "gamma": gammas,
        "normalize": method == "breadcrumbs_ties", "lambda": 0.9, "rescale": False,
    }  # fmt: skip
    assert get_method(method).fuses(params)
    want = None
    for bounds in ([0, n], [0, 1000, 1001, n], [0, 17, 2048, 2999, n]):
        fused = run(method, params, base, tasks, bounds, True, out_dtype)
        eager = run(method, params, base, tasks, bounds, False, out_dtype)
        assert fused[1] == eager[1]
        got = fused[0].view(torch.uint8)
        assert torch.equal(got, eager[0].view(torch.uint8))
        assert want is None or torch.equal(got, want)
        want = got
