"""breadcrumbs, breadcrumbs_ties, della and della_linear on chunks, as the engine runs them
(rounds over chunks, statistics summed, the state through JSON, then the map pass), against
the independent reference (`support/sparse_reference.py`) and mergekit 0.1.5 on whole
tensors (`dtype: float32` semantics)."""

from __future__ import annotations

import os

import pytest
import torch
from chunked_rounds import run_chunked
from sparse_reference import sparse_merge

from ram_dist.errors import RamDistError
from ram_dist.methods import get_method
from ram_dist.methods.generalized_task_arithmetic import breadcrumbs, della, topk
from ram_dist.methods.protocol import Chunk

try:
    import mergekit.merge_methods.base as mk_base
    import mergekit.merge_methods.registry as mk_registry
    import mergekit.sparsify as mk_sparsify
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    mk_base = mk_registry = mk_sparsify = None

needs_mergekit = pytest.mark.skipif(mk_registry is None, reason="mergekit (oracle) not installed")
pytestmark = pytest.mark.filterwarnings("ignore:numpy.core is deprecated:DeprecationWarning")

W = [0.7, -0.35, 1.25]


def make_inputs(shape, n_tasks=3, seed=0, scale=0.01):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    return base, [base + scale * torch.randn(shape, generator=gen) for _ in range(n_tasks)]


def params_of(method: str, **given) -> dict:
    """Every parameter the method is handed, mergekit's defaults where not given."""
    out = {p.name: p.default for p in get_method(method).parameters if p.passed}
    n = len(given.get("weight", W))
    for p in get_method(method).parameters:
        if p.per_task and p.passed:
            out[p.name] = [p.default] * n
    out.update(weight=list(W))
    out.update(given)
    return out


def run(method: str, base, tasks, bounds, params, name: str = "w") -> tuple[torch.Tensor, dict]:
    """The engine's rounds and map pass on chunks [bounds[i], bounds[i+1]) of flat indices."""
    return run_chunked(method, base, tasks, bounds, params, name)


def row_bounds(shape, rows: list[int]) -> list[int]:
    row = Chunk("w", 0, tuple(shape)).row
    return [r * row for r in rows]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def reference(method: str, base, tasks, params, name: str = "w") -> torch.Tensor:
    return sparse_merge(
        method, base, tasks, name=name, weights=params["weight"], densities=params["density"],
        gammas=params.get("gamma", ()), epsilons=params.get("epsilon", ()),
        normalize=params["normalize"], rescale=params["rescale"], lam=params["lambda"],
        seed=params.get("seed", 0),
    )  # fmt: skip


def mergekit_merge(method: str, base, tasks, params) -> torch.Tensor:
    impl = mk_registry.get(method)
    group = mk_base.TensorGroup.from_tensors([base, *tasks], base_index=0)
    ids = range(1, len(tasks) + 1)
    values = {s.name: s.default for s in impl.spec.parameters if s.default is not None}
    for key, value in params.items():
        if key != "seed":
            values[key] = dict(zip(ids, value, strict=True)) if isinstance(value, list) else value
    return impl.merge_group(group, **values)


def straddles(delta: torch.Tensor, density: float, gamma: float) -> bool:
    """Whether equal magnitudes straddle one of breadcrumbs' cuts (mergekit's choice among
    them is arbitrary)."""
    n = delta.numel()
    top = delta.abs().reshape(-1).sort(descending=True).values
    a, b = breadcrumbs.kept_range(density, gamma, n)
    return any(0 < k < n and top[k - 1] == top[k] for k in (a, b))


# ---------------------------------------------------------------- breadcrumbs

SETTINGS = [
    ([0.3, 0.7, 0.5], [0.01, 0.1, 0.0]),  # gamma 0: the plain top-k
    ([0.9, 0.95, 0.2], [0.2, 0.3, 0.9]),  # gamma + density > 1: fewer outliers dropped
    ([1.0, 1e-4, 0.5], [0.5, 0.5, 1.0]),  # untouched; nothing kept; the smallest half kept
]


@needs_mergekit
@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize(("densities", "gammas"), SETTINGS)
def test_breadcrumbs_matches_reference_and_mergekit(method, densities, gammas) -> None:
    base, tasks = make_inputs((48, 37), seed=len(method))
    params = params_of(method, density=densities, gamma=gammas, **{"lambda": 0.9})
    assert not any(
        straddles(t - base, d, g) for t, d, g in zip(tasks, densities, gammas, strict=True)
    )
    want = mergekit_merge(method, base, tasks, params)
    assert same_bytes(reference(method, base, tasks, params), want)
    n = base.numel()
    for bounds in ([0, n], [0, 1, 2, 700, 701, n], [*range(0, n, 128), n]):
        assert same_bytes(run(method, base, tasks, bounds, params)[0], want), bounds


@needs_mergekit
@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_breadcrumbs_rescale_is_the_reference_and_close_to_mergekit(method) -> None:
    """Same kept sets; the L1 factor is correctly rounded here, cascade-summed in mergekit."""
    base, tasks = make_inputs((48, 37), seed=7)
    params = params_of(method, density=[0.3, 0.6, 1e-4], gamma=[0.05, 0.01, 0.0], rescale=True)
    ours = run(method, base, tasks, [0, 5, 999, base.numel()], params)[0]
    assert same_bytes(ours, reference(method, base, tasks, params))
    torch.testing.assert_close(ours, mergekit_merge(method, base, tasks, params), rtol=0, atol=1e-6)


def test_breadcrumbs_equal_magnitudes_at_both_cuts_are_chunk_invariant() -> None:
    """Deltas from a few exact values: equal magnitudes straddle both cuts of every task,
    which then take the flat-index rounds; the kept sets are the reference's (a tensor over
    two flat-index bins with L1 rescaling, a small one without, cut into single elements)."""
    gen = torch.Generator().manual_seed(3)
    levels = torch.tensor([0.0, 0.25, -0.25, 0.5, -0.75, 1.0])
    for n, rescale in ((topk.LOW_BINS + 777, True), (300, False)):
        base = torch.randint(-64, 64, (n,), generator=gen) / 64.0
        tasks = [base + levels[torch.randint(0, 6, (n,), generator=gen)] for _ in range(3)]
        params = params_of(
            "breadcrumbs_ties", density=[0.3, 0.5, 0.2], gamma=[0.1, 0.25, 0.05], rescale=rescale
        )
        want = reference("breadcrumbs_ties", base, tasks, params)
        splits = [[0, n], [0, topk.LOW_BINS - 1, topk.LOW_BINS, n]] if rescale else [
            [0, n], [0, 1, 2, 3, 150, 151, 299, n]
        ]  # fmt: skip
        for bounds in splits:
            got, state = run("breadcrumbs_ties", base, tasks, bounds, params)
            assert same_bytes(got, want), (rescale, bounds)
        report = get_method("breadcrumbs_ties").report(state)
        assert report["breadcrumbs"]["cuts_through_equal_magnitudes"] == 6
        assert get_method("breadcrumbs").report_lines(report) == [
            "breadcrumbs cuts through equal magnitudes: 6"
        ]


@needs_mergekit
def test_breadcrumbs_cut_among_zeros_changes_no_byte() -> None:
    """RL-like sparse task vectors: both cuts of a task may fall among its zero deltas; which
    zeros are kept changes no byte, so no flat-index round runs and mergekit agrees."""
    gen = torch.Generator().manual_seed(21)
    base = torch.randn(48, 37, generator=gen)
    tasks = [
        torch.where(torch.rand(48, 37, generator=gen) < p, base + torch.randn(48, 37) * 0.01, base)
        for p in (0.03, 0.46, 0.54)
    ]
    params = params_of("breadcrumbs", density=[0.5, 0.5, 0.3], gamma=[0.6, 0.01, 0.1])
    m = get_method("breadcrumbs")
    got, state = run("breadcrumbs", base, tasks, [0, 100, base.numel()], params)
    assert m.report(state)["breadcrumbs"]["cuts_through_equal_magnitudes"] == 0
    assert not m.active(2, state, "w") and not m.active(3, state, "w")
    assert same_bytes(got, mergekit_merge("breadcrumbs", base, tasks, params))
    assert same_bytes(got, reference("breadcrumbs", base, tasks, params))


def test_breadcrumbs_kept_range_is_mergekits() -> None:
    """mergekit: keep `int(density * n)`, drop `int(gamma * n)` largest unless that leaves
    too few (its docs' example: density 0.9, gamma 0.01)."""
    assert breadcrumbs.kept_range(0.9, 0.01, 1000) == (10, 910)
    assert breadcrumbs.kept_range(0.9, 0.2, 1000) == (100, 1000)
    assert breadcrumbs.kept_range(1e-4, 0.5, 1000) == (500, 500)
    assert breadcrumbs.task_plan(1.0, 0.5, 1000) is None
    plan = breadcrumbs.task_plan(0.5, 0.0, 1000)
    assert plan is not None and plan["cuts"] == [None, {"k": 500}]


# ---------------------------------------------------------------- della

SHAPES = [
    ((48, 37), [0, 1, 20, 48]), ((300,), [0, 1]), ((4, 6, 5), [0, 1, 3, 4]), ((7, 1), [0, 3, 7])
]  # fmt: skip


@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize(("shape", "rows"), SHAPES)
@pytest.mark.parametrize("rescale", [True, False])
def test_della_is_the_reference_in_whole_rows(method, shape, rows, rescale) -> None:
    """Rows of a 2-D tensor, a 1-D tensor as one row, ranks along dimension 1 of a 3-D one,
    rows of one element (where mergekit fails): any split between rows, the same bytes."""
    base, tasks = make_inputs(shape, seed=sum(shape))
    params = params_of(
        method, density=[0.3, 0.7, 1.0], epsilon=[0.1, 0.2, 0.15], rescale=rescale, seed=3
    )
    want = reference(method, base, tasks, params)
    for split in ([0, shape[0]], rows):
        got, _ = run(method, base, tasks, row_bounds(shape, split), params)
        assert same_bytes(got, want), split


def test_della_equal_magnitudes_rank_the_lowest_index_highest() -> None:
    delta = torch.tensor([[0.5, -0.25, 0.25, 0.0, 0.5, -0.5]])
    ranks = della.row_ranks(topk.magnitude_keys(delta), 6, 1)
    assert ranks.tolist() == [6, 3, 2, 1, 5, 4]


@needs_mergekit
@pytest.mark.parametrize("shape", [(40, 33), (77,), (3, 10, 4)])
@pytest.mark.parametrize(("density", "epsilon"), [(0.5, 0.15), (0.3, 0.2999), (0.123, 0.0)])
def test_della_keep_probabilities_are_mergekits(monkeypatch, shape, density, epsilon) -> None:
    """The probabilities mergekit hands to `torch.bernoulli`, bit for bit."""
    seen = []
    bernoulli = torch.bernoulli
    monkeypatch.setattr(torch, "bernoulli", lambda p, *a, **k: seen.append(p) or bernoulli(p))
    delta = make_inputs(shape, seed=1)[1][0]
    mk_sparsify.della_magprune(delta, density, epsilon)
    n, inner = della.rank_groups(shape)
    ranks = della.row_ranks(topk.magnitude_keys(delta), n, inner)
    ours = della.keep_probabilities(ranks, n, density, epsilon)
    assert same_bytes(ours, seen[0].reshape(-1))


@needs_mergekit
@pytest.mark.parametrize("method", ["della", "della_linear"])
@pytest.mark.parametrize("rescale", [False, True])
def test_della_with_our_draws_is_mergekit(monkeypatch, method, rescale) -> None:
    """mergekit's whole merge with `torch.bernoulli` replaced by our draws: the same bytes
    without rescaling; with it, within the L1 factor's rounding."""
    base, tasks = make_inputs((48, 37), seed=11)
    params = params_of(method, density=[0.4, 0.66, 0.5], epsilon=[0.2, 0.05, 0.0], rescale=rescale)
    draws = iter(
        della.keep_mask(
            t - base, base.shape, seed=0, task=i, name="w", start=0, density=d, epsilon=e
        ).reshape(base.shape)
        for i, (t, d, e) in enumerate(zip(tasks, params["density"], params["epsilon"], strict=True))
    )
    monkeypatch.setattr(torch, "bernoulli", lambda p, *a, **k: next(draws).to(p.dtype))
    theirs = mergekit_merge(method, base, tasks, params)
    ours = run(method, base, tasks, row_bounds(base.shape, [0, 7, 48]), params)[0]
    if rescale:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    else:
        assert same_bytes(ours, theirs)


@needs_mergekit
@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_density_one_is_mergekit(method) -> None:
    """No draw matters at density 1 (epsilon is not read): byte-identical."""
    base, tasks = make_inputs((48, 37), seed=12)
    params = params_of(method, density=[1.0] * 3, **{"lambda": 0.5})
    assert not get_method(method).whole_rows(params)
    ours = run(method, base, tasks, [0, 1, 1000, base.numel()], params)[0]
    assert same_bytes(ours, mergekit_merge(method, base, tasks, params))


@needs_mergekit
def test_della_statistics_agree_with_mergekit() -> None:
    """Kept share, the expected L1 of the kept deltas (sum of p |delta|) and, rescaled, the
    L1 norm, for mergekit's global-generator masks and ours."""
    base, tasks = make_inputs((400, 250), n_tasks=1, seed=60)
    delta = tasks[0] - base
    density, epsilon = 0.4, 0.3
    n, inner = della.rank_groups(delta.shape)
    probs = della.keep_probabilities(
        della.row_ranks(topk.magnitude_keys(delta), n, inner), n, density, epsilon
    )
    expected_l1 = float((probs.double() * delta.reshape(-1).double().abs()).sum())
    l1 = float(delta.double().abs().sum())
    torch.manual_seed(0)
    theirs = {rescale: mk_sparsify.della_magprune(delta, density, epsilon, rescale) for rescale in
              (None, mk_sparsify.RescaleNorm.l1)}  # fmt: skip
    ours = {}
    for rescale in (None, mk_sparsify.RescaleNorm.l1):
        params = params_of("della_linear", weight=[1.0], density=[density], epsilon=[epsilon],
                           rescale=rescale is not None)  # fmt: skip
        ours[rescale] = run("della_linear", base, tasks, [0, base.numel()], params)[0] - base
    for side in (theirs, ours):
        plain, rescaled = side[None], side[mk_sparsify.RescaleNorm.l1]
        assert abs(float((plain != 0).double().mean()) - density) < 0.005
        assert float(plain.double().abs().sum()) == pytest.approx(expected_l1, rel=0.01)
        assert float(rescaled.double().abs().sum()) == pytest.approx(l1, rel=1e-5)
    # larger magnitudes are kept more often: the top half of each row more than the bottom
    keep = (ours[None] != 0).reshape(-1)
    assert float(keep[probs > density].double().mean()) > density + 0.1


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("density", "epsilon", "refused"),
    [(0.66, 1.35, True), (0.5, 0.5, True), (0.2, 0.2, True), (0.9, 0.1, True),
     (0.9, 0.0999, False), (1.0, 5.0, False), (0.5, 0.0, False)],
)  # fmt: skip
def test_della_epsilon_band_is_checked_as_mergekit_does(density, epsilon, refused) -> None:
    params = params_of("della", density=[0.5, density], epsilon=[0.1, epsilon])
    if not refused:
        get_method("della").check(params, "model.w")
        return
    with pytest.raises(RamDistError, match=r"^model\.w: parameter epsilon must keep .* task 2"):
        get_method("della").check(params, "model.w")
    if mk_sparsify is not None:
        with pytest.raises(ValueError, match="Epsilon"):
            mk_sparsify.della_magprune(torch.ones(4, 4), density, epsilon)
