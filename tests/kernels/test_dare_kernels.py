"""The fused DARE kernels (`dare_numba`) give exactly the eager torch path's bytes: the L1
round's statistics and the map pass of `dare_linear` and `dare_ties`, through the method
object (`fused_statistics`, `fused_merge` against `chunk_statistics`,
`merge_chunk(...).to(out_dtype)`), chunk by chunk as the engine runs them, over RL-like
sparse task vectors and pools of edge values (signed zeros, subnormals, sums that overflow
the 16-bit dtypes, infinities and NaN), rescaling on and off, densities 0, 1 and between,
mixed input and every output dtype, several chunkings around the kernels' tile. The draws
are `rng.random_bits`' at any flat index (beyond 2**32 too); no FMA in the compiled code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, sparse_inputs  # noqa: E402

from ram_dist.kernels import dare_numba, primitives, ram_numba  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402
from ram_dist.methods.generalized_task_arithmetic import dare  # noqa: E402
from ram_dist.methods.protocol import Chunk, ChunkWork  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TILE = primitives.TILE
INF, NAN = float("inf"), float("nan")


def dare_params(n_tasks: int, **kw) -> dict:
    params = {
        "weight": [0.7, -0.35, 1.25][:n_tasks], "density": [0.5, 0.3, 1.0][:n_tasks],
        "normalize": True, "lambda": 1.0, "rescale": True, "seed": 11,
    }  # fmt: skip
    return params | kw


def edge_inputs(n: int, dtypes: tuple[torch.dtype, ...], seed: int, nonfinite: bool = False):
    """Values from a small pool: signed zeros, subnormals (of float32 and of the 16-bit
    dtypes; 3e38 at most the dtype's largest value), magnitudes whose weighted sums overflow
    bf16 and fp16, and (`nonfinite`) a few infinities in every task and NaN in the last;
    each task equals the base at about half its elements."""
    pool = [0.0, -0.0, 0.25, -0.25, 0.5, -0.75, 1e-40, -3e-39, 3e-8, 6e4, -6e4, 3e38, 1.0]
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor(pool)
    pick = lambda: values[torch.randint(0, len(pool), (n,), generator=g)]  # noqa: E731
    base = pick()
    tasks = [torch.where(torch.rand(n, generator=g) < 0.5, pick(), base) for _ in dtypes[1:]]
    if nonfinite:
        for x in tasks:
            at = torch.randperm(n, generator=g)[:6]
            x[at] = torch.tensor([INF, -INF, INF, -INF, INF, NAN if x is tasks[-1] else INF])

    def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        top = torch.finfo(dtype).max  # 3e38 is fp16's largest value, not an infinity
        return torch.where(x.isfinite(), x.clamp(-top, top), x).to(dtype)

    return cast(base, dtypes[0]), [cast(t, d) for t, d in zip(tasks, dtypes[1:], strict=True)]


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).numpy()


def both(name, params, base, tasks, bounds, out_dtype):
    """The fused run (numpy inputs, as the engine hands them) and the eager one; asserts
    their states, statistics and bytes are equal (a NaN's bytes aside: where two NaNs meet,
    which one a product keeps is the compiled code's choice, and torch's differs between its
    vector loop and its tail, docs/exactness.md's "NaN bytes"; the output is NaN where the
    eager rule's is); returns the eager run."""
    fused = run(name, params, base, tasks, bounds, True, out_dtype, as_stored=True)
    eager = run(name, params, base, tasks, bounds, False, out_dtype)
    (got, state_f, totals_f), (want, state_e, totals_e) = fused, eager
    assert len(totals_f) == len(totals_e)
    for a, b in zip(totals_f, totals_e, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert repr(state_f) == repr(state_e)  # repr: NaN factors compare equal too
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    wide = got.element_size()
    same = bits(got).reshape(-1, wide) == bits(want).reshape(-1, wide)
    assert same[~nan.numpy()].all(), (name, out_dtype, got[:8], want[:8])
    return eager


DTYPE_SETS = [(BF16, BF16, BF16, BF16), (F32, BF16, F16, F32), (F16, F16, F16), (F32, F32)]
BOUNDS = lambda n: ([0, n], [0, 5, TILE + 1, n], [0, 1000, 1001, 2600, n])  # noqa: E731


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("dtypes", DTYPE_SETS, ids=lambda ds: "-".join(str(d)[6:] for d in ds))
@pytest.mark.parametrize("inputs", [sparse_inputs, edge_inputs])
def test_dare_fused_equals_eager(name, dtypes, inputs) -> None:
    """Rescaling on (the default) and off (with a negative weight sum), every output dtype,
    three chunkings; the cases the bytes must meet occur: factors applied, subnormal
    outputs, and on the edge pool infinite ones (sums overflow the 16-bit dtypes) and, for
    dare_linear, -0.0."""
    n = 2 * TILE + 37
    base, tasks = inputs(n, dtypes, seed=len(dtypes))
    seen: set[str] = set()
    for rescale in (True, False):
        params = dare_params(len(tasks), rescale=rescale)
        if not rescale:  # a negative weight sum: zero deltas normalize to -0.0
            params["weight"] = [-w for w in params["weight"]]
        for out_dtype, bounds in zip((BF16, F16, F32), BOUNDS(n), strict=True):
            merged, state, _ = both(name, params, base, tasks, bounds, out_dtype)
            factors = state["tensors"]["w"].get("factors") or []
            seen.update({"factor"} if any(f not in (None, 1.0) for f in factors) else set())
            m = merged.float()
            seen.update({"-0.0"} if bool(((m == 0) & m.signbit()).any()) else set())
            tiny = torch.finfo(out_dtype).tiny
            seen.update({"subnormal"} if bool(((m != 0) & (m.abs() < tiny)).any()) else set())
            seen.update({"inf"} if bool(m.isinf().any()) else set())
    want = {"factor", "subnormal"} | ({"inf"} if inputs is edge_inputs else set())
    if inputs is edge_inputs and name == "dare_linear":  # consensus: no task kept divides by 1
        want.add("-0.0")
    assert want <= seen, seen


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("rescale", [True, False])
def test_infinities_and_nan_fused_equal_eager(name, rescale) -> None:
    """Infinite and NaN task values: a dropped infinity is NaN in the kept vector (`inf *
    0.0`), so the kept L1 norm of a task without NaN is NaN (rescaling); the bytes, NaNs
    included, are the eager rule's."""
    n = TILE + 99
    base, tasks = edge_inputs(n, (F32, BF16, F16, F32), seed=5, nonfinite=True)
    params = dare_params(3, rescale=rescale, density=[0.5, 0.3, 0.8])
    for out_dtype in (BF16, F32):
        merged, state, totals = both(name, params, base, tasks, [0, 700, n], out_dtype)
        assert merged.float().isnan().any()
        assert rescale or merged.float().isinf().any()  # rescaling: NaN factors, NaN values
    if rescale:  # task 0 has no NaN; its kept statistic counts a dropped inf's NaN (2**32)
        stat = totals[0]["w"][0]
        assert 0 < int(stat[0, 255]) < 1 << 32 <= int(stat[1, 255])
        assert np.isnan(state["tensors"]["w"]["factors"][0])


@pytest.mark.parametrize("name", ["dare_linear", "dare_ties"])
def test_density_edges_fused_equal_eager(name) -> None:
    """Density 0 (every element dropped: `delta * 0.0`), a density that keeps a few
    elements, and 1 (untouched, no draws); lambda and normalize off and on."""
    base, tasks = sparse_inputs(5000, (F32, BF16, F16, F32), seed=13)
    for kw in ({"density": [0.0, 1e-3, 1.0]},
               {"density": [0.999, 0.0, 0.25], "normalize": False, "lambda": 0.8}):  # fmt: skip
        for rescale in (True, False):
            params = dare_params(3, rescale=rescale, **kw)
            both(name, params, base, tasks, [0, 2500, 5000], BF16)


def test_weights_summing_to_zero_and_one_task() -> None:
    """A plain weight sum below 1e-8 divides by 1 (normalize); one task alone."""
    base, tasks = sparse_inputs(3000, (BF16, BF16, BF16), seed=17)
    params = dare_params(2, weight=[0.5, -0.5])
    both("dare_linear", params, base, tasks, [0, 3000], F32)
    both("dare_ties", dare_params(1), base, tasks[:1], [0, 1234, 3000], F16)


@pytest.mark.parametrize("start", [0, 4093, (1 << 32) + 5])
def test_the_kernel_draws_rng_s_mask(start) -> None:
    """Ones over a zero base, weight 1, no rescale: the fused merge is the keep mask itself,
    which equals `dare.dare_keep_mask`'s at any flat index (beyond 2**32 too: the draws'
    index arithmetic is 64-bit)."""
    n = TILE + 10
    base = np.zeros(n, np.float32)
    task = np.ones(n, np.float32)
    density = 0.37
    out = np.empty(n, np.float32)
    from ram_dist.methods.generalized_task_arithmetic import rng

    key = rng.stream_key(3, 0, "model.w")
    kw = dict(start=start, stream_keys=[key], thresholds=[dare.keep_threshold(density)])
    dare_numba.merge(base, [task], out, **kw, factors=[None], weights=[1.0], consensus=False,
                     normalize=False, divisor=1.0, lambda_=1.0)  # fmt: skip
    want = dare.dare_keep_mask(3, 0, "model.w", start, start + n, density).numpy()
    assert np.array_equal(out, want.astype(np.float32))
    assert 0.3 < want.mean() < 0.44
    stats = dare_numba.statistics(base, [task], **kw)
    assert stats[0, 0, 127] == n << 23 and stats[0, 1, 127] == int(want.sum()) << 23


def test_no_fma_in_compiled_dare_kernels() -> None:
    """No FMA in the kernels' code, for every signature this process has used (one: records;
    `fma_check.fma_findings`)."""
    base, tasks = sparse_inputs(100, (F32, BF16, F16), seed=1)
    kw = dict(start=0, stream_keys=[1, None], thresholds=[1 << 23, 0])
    dare_numba.statistics(base, tasks, **kw)
    out = torch.empty(100, dtype=BF16)
    dare_numba.merge(base, tasks, out, **kw, factors=[1.5, None], weights=[0.5, 0.25],
                     consensus=True, normalize=True, divisor=1.0, lambda_=0.5)  # fmt: skip
    for kernel in dare_numba.KERNELS:
        assert kernel.signatures and ram_numba.fma_findings(kernel) == []


def test_the_methods_fuse_every_chunk() -> None:
    """`fuses` says the kernels take every chunk of DARE, rescaling or not, and its
    `fused_merge` writes it (the state of a run without rescaling has no factors)."""
    for name in ("dare_linear", "dare_ties"):
        method = get_method(name)
        for rescale in (True, False):
            assert method.fuses(dare_params(2, rescale=rescale))
        base, tasks = sparse_inputs(64, (F32, F32, F32), seed=2)
        params = dare_params(2, rescale=False)
        state = method.initial_state({"w": params}, {"w": 64}, 2)
        out = np.empty(64, np.float32)
        work = ChunkWork(Chunk("w", 0, (64,)), params, state)
        assert method.fused_merge(work, [x.numpy() for x in (base, *tasks)], out)
