"""Baselines (task_arithmetic, ties, dare_linear, dare_ties, linear) against mergekit.

mergekit (LGPL) is a test-time oracle only. Its functions run on whole float32 tensors;
ours run on flat chunks, as the engine does: reduce rounds over chunks, statistics summed as
the driver would, then a map pass, and the chunks concatenated. TIES runs through the
engine's own method object (`get_method("ties")`), round by round.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

import pytest
import torch

from ram_dist.methods import get_method, linear
from ram_dist.methods.generalized_task_arithmetic import combine, dare
from ram_dist.methods.generalized_task_arithmetic.topk import LOW_BINS, kept_count
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals, State

try:
    import mergekit.merge_methods.base as mk_base
    import mergekit.merge_methods.linear as mk_linear
    import mergekit.merge_methods.registry as mk_registry
    import mergekit.sparsify as mk_sparsify
except ImportError:  # the chunk-invariance tests still run; CI installs mergekit, so not there
    if os.environ.get("CI") == "true":
        raise
    mk_base = mk_linear = mk_registry = mk_sparsify = None

needs_mergekit = pytest.mark.skipif(mk_registry is None, reason="mergekit (oracle) not installed")
pytestmark = pytest.mark.filterwarnings("ignore:numpy.core is deprecated:DeprecationWarning")

SHAPE = (48, 37)  # 1776 elements: not a multiple of any vector width
WEIGHTS = [0.7, -0.35, 1.25, 0.4]
Bounds = list[int]


# ---------------------------------------------------------------- inputs and oracles


def make_inputs(n_tasks: int, seed: int = 0, shape: tuple[int, ...] = SHAPE):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    tasks = [base + 0.01 * torch.randn(shape, generator=gen) for _ in range(n_tasks)]
    return base, tasks


def mergekit_gta(method: str, base, tasks, weights, densities=None, **params) -> torch.Tensor:
    """mergekit's generalized task arithmetic on whole tensors (`dtype: float32` semantics)."""
    impl = mk_registry.get(method)
    group = mk_base.TensorGroup.from_tensors([base, *tasks], base_index=0)
    ids = range(1, len(tasks) + 1)
    values = {s.name: s.default for s in impl.spec.parameters if s.default is not None}
    values.update(weight=dict(zip(ids, weights, strict=True)))
    values.update(density=dict(zip(ids, densities or [1.0] * len(tasks), strict=True)))
    values.update(params)
    return impl.merge_group(group, **values)


def bounds_list(n: int, seed: int = 0) -> list[Bounds]:
    """Several chunkings of [0, n): whole, tiny, uneven random, and fixed blocks."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, n, (9,), generator=gen).tolist()))
    return [[0, n], [0, 1, 2, 3, n - 2, n - 1, n], [0, *cuts, n], [*range(0, n, 128), n]]


def chunks_of(x: torch.Tensor, bounds: Bounds) -> list[torch.Tensor]:
    flat = x.reshape(-1)
    return [flat[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]


def split(base, tasks, bounds: Bounds):
    """Per chunk: (start, base chunk, task chunks)."""
    pieces = zip(chunks_of(base, bounds), *(chunks_of(t, bounds) for t in tasks), strict=True)
    return [(lo, b, list(ts)) for lo, (b, *ts) in zip(bounds, pieces, strict=False)]


def total(stats: Sequence[torch.Tensor]) -> torch.Tensor:
    """The driver's sum of per-chunk int64 statistics."""
    out = stats[0].clone()
    for s in stats[1:]:
        out += s
    return out


# ---------------------------------------------------------------- engine simulations


def run_ta(base, tasks, bounds, **kw) -> torch.Tensor:
    parts = [combine.merge_chunk(b, ts, **kw) for _, b, ts in split(base, tasks, bounds)]
    return torch.cat(parts).reshape(base.shape)


def ties_state(base, tasks, bounds, weights, densities, *, rescale=False, normalize=True,
               lambda_=1.0, name="w"):  # fmt: skip
    """The engine's reduce rounds of TIES on one tensor: per chunk `chunk_statistics` of the
    active rounds, summed as the driver does, then `finalize`; the state goes through JSON
    between rounds, as it does through the manifest. Returns (params, state)."""
    method = get_method("ties")
    params = {
        "weight": list(weights), "density": list(densities), "normalize": normalize,
        "lambda": lambda_, "rescale": rescale,
    }  # fmt: skip
    numel = base.numel()
    state: State = method.initial_state({name: params}, {name: numel}, len(tasks))
    for round_ in range(method.rounds):
        if not method.active(round_, state, name):
            continue
        totals: dict[str, torch.Tensor] = {}
        for lo, b, ts in split(base, tasks, bounds):
            stats = method.chunk_statistics(
                ChunkWork(Chunk(name, lo, (numel,)), params, state, round_), b, ts
            )
            for key, value in stats.items():
                assert value.dtype == torch.int64, key
                totals[key] = totals[key] + value if key in totals else value
        state = method.finalize(RoundTotals(round_, totals, {name: params}, {name: numel}, state))
        state = json.loads(json.dumps(state))
    return params, state


def run_ties(base, tasks, bounds, weights, densities, rescale=False, name="w", **kw):
    """TIES as the engine runs it: `ties_state`, then the map pass chunk by chunk."""
    method = get_method("ties")
    params, state = ties_state(
        base, tasks, bounds, weights, densities, rescale=rescale, name=name, **kw
    )
    numel = base.numel()
    parts = [
        method.merge_chunk(ChunkWork(Chunk(name, lo, (numel,)), params, state), b, ts)
        for lo, b, ts in split(base, tasks, bounds)
    ]
    return torch.cat(parts).reshape(base.shape)


def reference_ties(base, tasks, weights, densities, normalize=True, lambda_=1.0) -> torch.Tensor:
    """TIES on whole tensors with the spec's cut: a stable sort by (-|delta|, flat index)."""
    b, deltas = combine.task_vectors(base, tasks)
    sparse = []
    for d, density in zip(deltas, densities, strict=True):
        if density >= 1:
            sparse.append(d)
            continue
        order = torch.sort(d.reshape(-1).abs(), descending=True, stable=True).indices
        keep = torch.zeros(d.numel(), dtype=torch.bool)
        keep[order[: kept_count(density, d.numel())]] = True
        sparse.append(dare.sparsify(d, keep, None))
    merged = combine.combine(
        b, sparse, weights, consensus=True, normalize=normalize, lambda_=lambda_
    )
    return merged.reshape(base.shape)


def cuts_through_equal(state: State) -> int:
    return get_method("ties").report(state)["ties"]["cuts_through_equal_magnitudes"]


def run_dare(base, tasks, bounds, weights, densities, *, rescale=True, seed=5, name="w", **kw):
    chunks = split(base, tasks, bounds)
    factors: list[float | None] = [None] * len(tasks)
    if rescale:
        stats = total(
            [
                dare.chunk_statistics(b, ts, seed=seed, name=name, start=lo, densities=densities)
                for lo, b, ts in chunks
            ]
        )
        factors = dare.rescale_factors(stats, densities)
    parts = [
        dare.merge_chunk(
            b,
            ts,
            weights,
            seed=seed,
            name=name,
            start=lo,
            densities=densities,
            factors=factors,
            **kw,
        )
        for lo, b, ts in chunks
    ]
    return torch.cat(parts).reshape(base.shape)


def run_linear(inputs, bounds, weights, **kw) -> torch.Tensor:
    pieces = zip(*(chunks_of(x, bounds) for x in inputs), strict=True)
    return torch.cat([linear.merge_chunk(list(p), weights, **kw) for p in pieces]).reshape(
        inputs[0].shape
    )


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_chunk_invariant(run: Callable[[Bounds], torch.Tensor], n: int) -> torch.Tensor:
    whole = run([0, n])
    for bounds in bounds_list(n)[1:]:
        assert same_bytes(run(bounds), whole), bounds
    return whole


def no_tie_at_cut(delta: torch.Tensor, density: float) -> bool:
    k = kept_count(density, delta.numel())
    top = delta.abs().reshape(-1).sort(descending=True).values
    return k == delta.numel() or bool(top[k - 1] != top[k])


# ---------------------------------------------------------------- task arithmetic


@needs_mergekit
@pytest.mark.parametrize("n_tasks", [2, 3, 4])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("lam", [1.0, 0.7])
def test_task_arithmetic_matches_mergekit(n_tasks: int, normalize: bool, lam: float) -> None:
    base, tasks = make_inputs(n_tasks, seed=n_tasks)
    w = WEIGHTS[:n_tasks]
    ref = mergekit_gta("task_arithmetic", base, tasks, w, normalize=normalize, **{"lambda": lam})
    ours = assert_chunk_invariant(
        lambda bd: run_ta(base, tasks, bd, weights=w, normalize=normalize, lambda_=lam),
        base.numel(),
    )
    assert same_bytes(ours, ref)


@needs_mergekit
def test_task_arithmetic_zero_weight_sum_is_not_divided() -> None:
    base, tasks = make_inputs(2)
    w = [0.5, -0.5]
    ref = mergekit_gta("task_arithmetic", base, tasks, w, normalize=True)
    assert same_bytes(combine.merge_chunk(base, tasks, w, normalize=True), ref)


@needs_mergekit
def test_five_tasks_agree_within_sum_rounding() -> None:
    """N >= 5: mergekit's task-axis sum order depends on position; ours is task order."""
    base, tasks = make_inputs(5, seed=9)
    w = [*WEIGHTS, 0.3]
    ref = mergekit_gta("task_arithmetic", base, tasks, w)
    ours = combine.merge_chunk(base, tasks, w)
    scale = sum(abs(wt) * (t - base).abs() for wt, t in zip(w, tasks, strict=True)) + base.abs()
    assert bool(((ours - ref).abs() <= 4 * 2.0**-24 * scale).all())


# ---------------------------------------------------------------- TIES


@needs_mergekit
@pytest.mark.parametrize("n_tasks", [2, 3, 4])
@pytest.mark.parametrize("densities", [(0.3, 0.3, 0.3, 0.3), (0.7, 0.3, 0.7, 0.5)])
@pytest.mark.parametrize("normalize", [True, False])
def test_ties_matches_mergekit(n_tasks: int, densities, normalize: bool) -> None:
    base, tasks = make_inputs(n_tasks, seed=10 + n_tasks)
    dens, w = list(densities[:n_tasks]), WEIGHTS[:n_tasks]
    assert all(no_tie_at_cut(t - base, d) for t, d in zip(tasks, dens, strict=True))
    ref = mergekit_gta("ties", base, tasks, w, dens, normalize=normalize, **{"lambda": 0.9})
    ours = assert_chunk_invariant(
        lambda bd: run_ties(base, tasks, bd, w, dens, normalize=normalize, lambda_=0.9),
        base.numel(),
    )
    assert same_bytes(ours, ref)


@needs_mergekit
def test_ties_density_edges_match_mergekit() -> None:
    base, tasks = make_inputs(3, seed=4)
    dens = [1.0, 0.0, 1e-6]  # untouched, all dropped, a single element kept
    ref = mergekit_gta("ties", base, tasks, WEIGHTS[:3], dens)
    ours = assert_chunk_invariant(
        lambda bd: run_ties(base, tasks, bd, WEIGHTS[:3], dens), base.numel()
    )
    assert same_bytes(ours, ref)


@pytest.mark.parametrize("n_tasks", [2, 5])
def test_chunk_invariance_without_mergekit(n_tasks: int) -> None:
    base, tasks = make_inputs(n_tasks, seed=80)
    w, dens = [*WEIGHTS, 0.3][:n_tasks], [0.3, 0.7, 0.5, 0.2, 0.9][:n_tasks]
    n = base.numel()
    assert_chunk_invariant(lambda bd: run_ta(base, tasks, bd, weights=w, normalize=True), n)
    assert_chunk_invariant(lambda bd: run_ties(base, tasks, bd, w, dens, lambda_=1.3), n)
    assert_chunk_invariant(lambda bd: run_linear([base, *tasks], bd, [1.0, *w]), n)


def test_ties_many_ties_at_cut_is_chunk_invariant() -> None:
    """Deltas from a tiny set of exact values: many equal magnitudes straddle every cut."""
    gen = torch.Generator().manual_seed(3)
    levels = torch.tensor([0.0, 0.25, -0.25, 0.5, -0.75])
    base = torch.randint(-64, 64, (300,), generator=gen) / 64.0  # exact sums with the levels
    tasks = [base + levels[torch.randint(0, 5, (300,), generator=gen)] for _ in range(3)]
    dens = [0.3, 0.5, 0.71]
    assert not any(no_tie_at_cut(t - base, d) for t, d in zip(tasks, dens, strict=True))
    for rescale in (False, True):
        assert_chunk_invariant(
            lambda bd, r=rescale: run_ties(base, tasks, bd, WEIGHTS[:3], dens, rescale=r), 300
        )
    _, state = ties_state(base, tasks, [0, 300], WEIGHTS[:3], dens)
    assert cuts_through_equal(state) == 3  # every task takes the flat-index rounds
    ref = reference_ties(base, tasks, WEIGHTS[:3], dens)
    assert same_bytes(run_ties(base, tasks, [*range(301)], WEIGHTS[:3], dens), ref)
    small, few = base[:40], [t[:40] for t in tasks]
    singles = run_ties(small, few, [*range(41)], WEIGHTS[:3], dens, rescale=True)
    assert same_bytes(singles, run_ties(small, few, [0, 40], WEIGHTS[:3], dens, rescale=True))


@needs_mergekit
def test_ties_cut_among_zeros_skips_the_index_rounds() -> None:
    """RL-like sparse task vectors (most deltas exactly 0) with a density above the changed
    fraction: the cut falls among the zeros. Which zeros are kept changes no byte, so the
    flat-index rounds do not run, and the bytes still equal a stable top-k and mergekit."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(SHAPE, generator=gen)
    tasks = [
        torch.where(torch.rand(SHAPE, generator=gen) < p, base + torch.randn(SHAPE) * 0.01, base)
        for p in (0.03, 0.46, 0.54)
    ]
    dens = [0.5, 0.5, 0.3]  # tasks 1 and 2 cut among zeros, task 3 among changed values
    method = get_method("ties")
    _, state = ties_state(base, tasks, [0, base.numel()], WEIGHTS[:3], dens)
    cuts = state["tensors"]["w"]["cuts"]
    assert [c["threshold"] == 0 and c["need"] < c["equal"] for c in cuts] == [True, True, False]
    assert not method.active(2, state, "w") and not method.active(3, state, "w")
    ref = reference_ties(base, tasks, WEIGHTS[:3], dens)
    ours = assert_chunk_invariant(
        lambda bd: run_ties(base, tasks, bd, WEIGHTS[:3], dens), base.numel()
    )
    assert same_bytes(ours, ref)
    assert same_bytes(ours, mergekit_gta("ties", base, tasks, WEIGHTS[:3], dens))


def test_ties_equal_magnitudes_over_several_index_bins() -> None:
    """A tensor over three flat-index bins of 65536; an uncut task gives zero index rows."""
    n = 2 * LOW_BINS + 999
    gen = torch.Generator().manual_seed(5)
    levels = torch.tensor([0.0, 0.25, -0.25, 0.5, -0.75])
    base = torch.randint(-64, 64, (n,), generator=gen) / 64.0
    tasks = [base + levels[torch.randint(0, 5, (n,), generator=gen)] for _ in range(3)]
    dens = [0.2, 1.0, 0.5]  # index cuts in the last and the first bin
    ref = reference_ties(base, tasks, WEIGHTS[:3], dens)
    edges = [m + d for m in (LOW_BINS, 2 * LOW_BINS) for d in (-2, -1, 0, 1)]
    for bounds in ([0, n], [0, *edges, n], [*range(0, n, 40_000), n]):
        assert same_bytes(run_ties(base, tasks, bounds, WEIGHTS[:3], dens), ref), bounds
    _, state = ties_state(base, tasks, [0, *edges, n], WEIGHTS[:3], dens)
    cuts = state["tensors"]["w"]["cuts"]
    assert cuts_through_equal(state) == 2 and cuts[1] is None
    assert [cuts[0]["index_bin"], cuts[2]["index_bin"]] == [2, 0]


@needs_mergekit
def test_ties_rescale_close_to_mergekit() -> None:
    """Same masks; the L1 factor is correctly rounded here, cascade-summed in mergekit."""
    base, tasks = make_inputs(3, seed=21)
    dens = [0.3, 0.6, 0.45]
    ref = mergekit_gta("ties", base, tasks, WEIGHTS[:3], dens, rescale=True)
    ours = assert_chunk_invariant(
        lambda bd: run_ties(base, tasks, bd, WEIGHTS[:3], dens, rescale=True), base.numel()
    )
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- DARE


@needs_mergekit
@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("n_tasks", [2, 3, 4])
def test_dare_density_one_matches_mergekit(method: str, n_tasks: int) -> None:
    base, tasks = make_inputs(n_tasks, seed=30 + n_tasks)
    w = WEIGHTS[:n_tasks]
    ref = mergekit_gta(method, base, tasks, w, normalize=True, **{"lambda": 1.1})
    ours = assert_chunk_invariant(
        lambda bd: run_dare(
            base,
            tasks,
            bd,
            w,
            [1.0] * n_tasks,
            consensus=method == "dare_ties",
            normalize=True,
            lambda_=1.1,
        ),
        base.numel(),
    )
    assert same_bytes(ours, ref)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("rescale", [True, False])
def test_dare_chunk_invariant(method: str, rescale: bool) -> None:
    base, tasks = make_inputs(3, seed=40)
    assert_chunk_invariant(
        lambda bd: run_dare(
            base,
            tasks,
            bd,
            WEIGHTS[:3],
            [0.5, 0.2, 0.9],
            rescale=rescale,
            consensus=method == "dare_ties",
        ),
        base.numel(),
    )


@needs_mergekit
def test_dare_half_density_statistics() -> None:
    """Kept fraction near 0.5 and the rescaled task vector keeps the L1 norm, per task."""
    base, tasks = make_inputs(2, seed=50, shape=(400, 250))
    n = base.numel()
    for t, task in enumerate(tasks):
        delta = task - base
        bounds = bounds_list(n)[2]
        stats = total(
            [
                dare.chunk_statistics(b, [ts[t]], seed=1, name="x", start=lo, densities=[0.5])
                for lo, b, ts in split(base, tasks, bounds)
            ]
        )
        (factor,) = dare.rescale_factors(stats, [0.5])
        assert factor is not None
        keep = dare.dare_keep_mask(1, 0, "x", 0, n, 0.5)
        assert abs(float(keep.float().mean()) - 0.5) < 0.005
        ours = dare.sparsify(delta.reshape(-1), keep, factor)
        l1, l1_ours = delta.double().abs().sum(), ours.double().abs().sum()
        assert abs(float(l1_ours / l1) - 1) < 1e-5
        # mergekit's own rule on the same mask gives the same vector up to the factor's rounding.
        theirs = mk_sparsify.rescaled_masked_tensor(
            delta.reshape(-1), keep.float(), mk_sparsify.RescaleNorm.l1
        )
        torch.testing.assert_close(ours, theirs, rtol=4e-7, atol=0)


@needs_mergekit
def test_mergekit_dare_statistics_agree_with_ours() -> None:
    """mergekit's global-RNG masks cannot be reproduced; compare distributions instead."""
    base, tasks = make_inputs(1, seed=60, shape=(300, 200))
    delta = tasks[0] - base
    torch.manual_seed(0)
    theirs = mk_sparsify.bernoulli(delta, 0.5, mk_sparsify.RescaleNorm.l1)
    ours = run_dare(base, tasks, [0, base.numel()], [1.0], [0.5], consensus=False) - base
    for out in (theirs, ours):
        assert abs(float((out != 0).float().mean()) - 0.5) < 0.01
        assert abs(float(out.double().abs().sum() / delta.double().abs().sum()) - 1) < 1e-5


# ---------------------------------------------------------------- linear


@needs_mergekit
@pytest.mark.parametrize("n_inputs", [2, 3, 4])
@pytest.mark.parametrize("normalize", [True, False])
def test_linear_matches_mergekit(n_inputs: int, normalize: bool) -> None:
    base, tasks = make_inputs(n_inputs - 1, seed=70 + n_inputs)
    inputs, w = [base, *tasks], [0.3, 0.9, 0.45, 1.7][:n_inputs]
    batch = mk_base.TensorBatch(tuple(x.unsqueeze(0) for x in inputs))
    ref = mk_linear.linear_merge.implementation(
        batch, weight=torch.tensor([w]), normalize=normalize
    )[0]
    ours = assert_chunk_invariant(
        lambda bd: run_linear(inputs, bd, w, normalize=normalize), base.numel()
    )
    # mergekit's addcmul_ may fuse multiply and add; ours rounds each product (CPU == GPU).
    assert linear_close(ours, ref, inputs, w, normalize)


def linear_close(ours, ref, inputs, w, normalize) -> bool:
    """Within a float32 rounding of each term (and of the division)."""
    terms = sum(abs(wt) * x.abs() for wt, x in zip(w, inputs, strict=True))
    bound = 4 * 2.0**-24 * terms / (abs(sum(w)) if normalize else 1)
    return bool(((ours - ref).abs() <= bound).all())


# ---------------------------------------------------------------- mergekit end to end


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A float32 tiny Llama base and three sparse RL-like tasks, as real checkpoints."""
    from builders import build_model_set

    root = tmp_path_factory.mktemp("baselines")
    return build_model_set(root, base_dtype=torch.float32, densities=(0.4, 0.6, 0.5))


E2E_WEIGHTS = [0.7, -0.35, 1.25]
E2E_DENSITIES = [0.3, 0.7, 0.5]


def _ours(method: str, base: torch.Tensor, tasks: list[torch.Tensor]) -> torch.Tensor:
    bounds = [0, base.numel() // 3, base.numel() // 3 + 1, base.numel()]
    w, dens = E2E_WEIGHTS, E2E_DENSITIES
    if method == "ties":
        return run_ties(base, tasks, bounds, w, dens)
    if method == "task_arithmetic":
        return run_ta(base, tasks, bounds, weights=w, lambda_=0.8)
    if method == "dare_ties":
        return run_dare(base, tasks, bounds, w, [1.0] * 3, consensus=True)
    return run_linear([base, *tasks], bounds, [0.5, *w[:1], *w[2:]])


@needs_mergekit
@pytest.mark.parametrize("method", ["ties", "task_arithmetic", "dare_ties", "linear"])
def test_mergekit_run_merge_matches_chunked(tiny_models, tmp_path, method: str) -> None:
    """mergekit's whole pipeline (`dtype: float32`) on real checkpoints, every tensor."""
    from builders import load_checkpoint
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    base_dir, task_dirs, base_state, task_states = tiny_models
    if method == "linear":
        models = [
            (base_dir, 0.5, 1.0),
            (task_dirs[0], E2E_WEIGHTS[0], 1.0),
            (task_dirs[2], E2E_WEIGHTS[2], 1.0),
        ]
        used = [task_states[0], task_states[2]]
    else:
        dens = [1.0] * 3 if method == "dare_ties" else E2E_DENSITIES
        models = list(zip(task_dirs, E2E_WEIGHTS, dens, strict=True))
        used = task_states
    config = {
        "merge_method": method,
        "dtype": "float32",
        "models": [
            {"model": str(d), "parameters": {"weight": w, "density": k}} for d, w, k in models
        ],
    }
    if method != "linear":
        config["base_model"] = str(base_dir)
    if method == "task_arithmetic":
        config["parameters"] = {"lambda": 0.8}
    out = tmp_path / "out"
    run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True, copy_tokenizer=False),
    )
    merged = load_checkpoint(out)
    assert sorted(merged) == sorted(base_state)
    for name, base in base_state.items():
        ours = _ours(method, base, [t[name] for t in used])
        if method == "linear":
            inputs = [base, *[t[name] for t in used]]
            w = [0.5, *E2E_WEIGHTS[:1], *E2E_WEIGHTS[2:]]
            assert linear_close(ours, merged[name], inputs, w, True), name
        else:
            assert same_bytes(ours, merged[name]), name
