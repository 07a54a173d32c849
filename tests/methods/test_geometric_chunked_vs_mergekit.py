"""slerp, nuslerp, multislerp and karcher on chunks, as the engine runs them (reduce round per
chunk, integer statistics summed, `finalize`, the state through JSON, the map pass per
chunk), against the spec's reference (`geometric_reference`, byte for byte, at every split)
and against mergekit's own functions on whole tensors (within the spec's bound)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from geometric_reference import karcher, multislerp, nuslerp, slerp

from ram_dist.errors import RamDistError
from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals

try:
    from mergekit.merge_methods import registry as mk_registry
    from mergekit.merge_methods.base import TensorGroup
except ImportError:  # the reference tests still run; CI installs mergekit
    if os.environ.get("CI") == "true":
        raise
    mk_registry = None

needs_mergekit = pytest.mark.skipif(mk_registry is None, reason="mergekit (oracle) not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHAPE = (48, 37)


def inputs(n: int, spread: float, seed: int = 0, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    return base, [base + spread * torch.randn(shape, generator=gen) for _ in range(n)]


def bounds_list(n: int, row: int = 1) -> list[list[int]]:
    """Several splits of [0, n) at multiples of `row` (whole rows): whole, one row at a time
    at the ends, uneven, fixed blocks."""
    rows = n // row
    if rows < 4:
        return [[0, n], [*range(0, n, row), n]]
    gen = torch.Generator().manual_seed(n)
    cuts = sorted(set((torch.randint(1, rows, (5,), generator=gen) * row).tolist()))
    return [
        [0, n],
        [0, row, 2 * row, n - row, n],
        [0, *cuts, n],
        [*range(0, n, 7 * row), n],
    ]


def run(name: str, params: dict, base, tasks, bounds, tensor: str = "w"):
    """The engine's round and map pass over chunks; returns (merged, state)."""
    method = get_method(name)
    numel = base.numel()
    flat_base = base.reshape(-1)
    flat_tasks = [t.reshape(-1) for t in tasks]

    def chunk(lo: int) -> Chunk:
        return Chunk(tensor, lo, tuple(base.shape))

    state = method.initial_state({tensor: params}, {tensor: numel}, len(tasks))
    state = json.loads(json.dumps(state))
    for round_ in range(method.rounds):
        if not method.active(round_, state, tensor):
            continue
        totals: dict = {}
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            stats = method.chunk_statistics(
                ChunkWork(chunk(lo), params, state, round_),
                flat_base[lo:hi],
                [t[lo:hi] for t in flat_tasks],
            )
            for key, value in stats.items():
                assert value.dtype == torch.int64, key
                totals[key] = totals[key] + value if key in totals else value
        state = method.finalize(
            RoundTotals(round_, totals, {tensor: params}, {tensor: numel}, state)
        )
        state = json.loads(json.dumps(state))
    parts = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        pieces = flat_base[lo:hi], [t[lo:hi] for t in flat_tasks]
        parts.append(method.merge_chunk(ChunkWork(chunk(lo), params, state), *pieces))
    return torch.cat([p.reshape(-1) for p in parts]).reshape(base.shape), state


def same_bytes(ours: torch.Tensor, reference: np.ndarray) -> None:
    want = torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32))
    assert ours.dtype == torch.float32
    differ = int((ours.view(torch.int32) != want.view(torch.int32)).sum())
    assert differ == 0, f"{differ} elements differ from the reference"


def every_split(name, params, base, tasks, reference, row: int = 1):
    states = []
    for bounds in bounds_list(base.numel(), row):
        merged, state = run(name, params, base, tasks, bounds)
        same_bytes(merged, reference)
        states.append(state)
    assert all(s == states[0] for s in states)
    return merged, states[0]


def mergekit(name: str, tensors, base_index, params) -> torch.Tensor:
    group = TensorGroup.from_tensors(list(tensors), base_index=base_index)
    return mk_registry.get(name)([group], parameters=params)[0]


def within_bound(ours, theirs, magnitudes) -> int:
    """The spec's parity bound; returns how many elements differ at all."""
    bound = 2.0**-20 * sum(m.abs() for m in magnitudes)
    assert ((ours - theirs).abs() <= bound).all(), float(((ours - theirs).abs() / bound).max())
    return int((ours != theirs).sum())


# ---------------------------------------------------------------- slerp


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 1.0, 1.7, -0.25])
@pytest.mark.parametrize("spread", [1.0, 0.01])
def test_slerp(t, spread):
    base, (task,) = inputs(1, spread, seed=1)
    params = {"t": t}
    merged, state = every_split("slerp", params, base, [task], slerp(base, task, t))
    linear = spread == 0.01
    assert state["tensors"]["w"].get("linear", False) is linear
    if mk_registry is not None:
        theirs = mergekit("slerp", [base, task], 0, params)
        differ = within_bound(merged, theirs, [base, task])
        if linear:  # the linear branch is element-wise: mergekit's bytes
            assert differ == 0


def test_slerp_with_a_zero_base_takes_its_norm_as_one():
    base, (task,) = inputs(1, 1.0, seed=2)
    base = torch.zeros_like(base)
    merged, _ = every_split("slerp", {"t": 0.4}, base, [task], slerp(base, task, 0.4))
    if mk_registry is not None:
        within_bound(merged, mergekit("slerp", [base, task], 0, {"t": 0.4}), [base, task])


def test_slerp_requires_t():
    from ram_dist.methods.parameters import Parameter

    (t,) = get_method("slerp").parameters
    assert isinstance(t, Parameter) and t.name == "t" and t.default is None
    with pytest.raises(RamDistError, match="parameter t is required"):
        t.validate(None, "tensor 'w'")


# ---------------------------------------------------------------- nuslerp


VARIANTS = {"whole": (True, False), "rows": (False, False), "columns": (False, True)}


@pytest.mark.parametrize("weights", [(0.3, 0.9), (1.0, 1.0), (1.0, -1.0), (2.0, -0.5)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nuslerp(weights, variant):
    base, tasks = inputs(2, 0.5, seed=3)
    flatten, row_wise = VARIANTS[variant]
    params = {"weight": list(weights), "nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
    row = 1 if flatten else SHAPE[-1]
    reference = nuslerp(base, tasks, list(weights), flatten=flatten, row_wise=row_wise)
    merged, _ = every_split("nuslerp", params, base, tasks, reference, row)
    if mk_registry is not None:
        theirs = mergekit("nuslerp", [base, *tasks], 0, {k: v for k, v in params.items()})
        within_bound(merged, theirs, [base, *tasks])


@pytest.mark.parametrize("shape", [(40,), (6, 5, 8)])
@pytest.mark.parametrize("row_wise", [False, True])
def test_nuslerp_rows_and_columns_of_other_ranks(shape, row_wise):
    """A 1-D tensor is one vector; a 3-D one is interpolated along its last (or first)
    dimension, in chunks of whole first-dimension rows."""
    base, tasks = inputs(2, 0.5, seed=4, shape=shape)
    params = {"weight": [0.4, 0.6], "nuslerp_flatten": False, "nuslerp_row_wise": row_wise}
    row = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    reference = nuslerp(base, tasks, [0.4, 0.6], flatten=False, row_wise=row_wise)
    merged, _ = every_split("nuslerp", params, base, tasks, reference, row)
    if mk_registry is not None:
        theirs = mergekit("nuslerp", [base, *tasks], 0, params)
        within_bound(merged, theirs, [base, *tasks])


def test_nuslerp_colinear_task_vectors_blend_linearly_as_mergekit():
    base, (task,) = inputs(1, 0.3, seed=5)
    other = base + 2.0 * (task - base)  # the same direction: colinear
    params = {"weight": [0.25, 0.75], "nuslerp_flatten": True, "nuslerp_row_wise": False}
    merged, state = every_split(
        "nuslerp", params, base, [task, other], nuslerp(base, [task, other], [0.25, 0.75])
    )
    assert state["tensors"]["w"]["divisor"] == 1.0
    if mk_registry is not None:
        theirs = mergekit("nuslerp", [base, task, other], 0, params)
        assert within_bound(merged, theirs, [base, task, other]) == 0


def test_nuslerp_colinear_columns_blend_linearly():
    _, (task, other) = inputs(2, 0.3, seed=5)
    base = torch.zeros(SHAPE)
    other[:, :10] = 2 * task[:, :10]  # columns 0-9 in the same direction: colinear
    params = {"weight": [0.25, 0.75], "nuslerp_flatten": False, "nuslerp_row_wise": True}
    reference = nuslerp(base, [task, other], [0.25, 0.75], flatten=False, row_wise=True)
    merged, state = every_split("nuslerp", params, base, [task, other], reference, SHAPE[1])
    divisors = state["tensors"]["w"]["columns"][2]
    assert divisors[:10] == [1.0] * 10 and 1.0 not in divisors[10:]
    if mk_registry is not None:
        theirs = mergekit("nuslerp", [base, task, other], 0, params)
        within_bound(merged, theirs, [base, task, other])


# ---------------------------------------------------------------- multislerp


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("normalize", [True, False])
def test_multislerp(n, normalize):
    base, tasks = inputs(n, 0.5, seed=6 + n)
    weights = [0.3, 0.9, 0.5, 1.2][:n]
    params = {"weight": weights, "normalize_weights": normalize, "eps": 1e-8}
    reference = multislerp(base, tasks, weights, normalize)
    merged, _ = every_split("multislerp", params, base, tasks, reference)
    if mk_registry is not None:
        theirs = mergekit("multislerp", [base, *tasks], 0, params)
        within_bound(merged, theirs, [base, *tasks])


def test_multislerp_of_one_model_is_that_model():
    base, tasks = inputs(1, 0.5, seed=11)
    params = {"weight": [0.7], "normalize_weights": True, "eps": 1e-8}
    merged, state = every_split("multislerp", params, base, tasks, multislerp(base, tasks, [0.7]))
    assert state["tensors"] == {}  # no round
    if mk_registry is not None:
        assert torch.equal(merged, mergekit("multislerp", [base, *tasks], 0, params))


def test_multislerp_antipodal_pair_falls_back_to_the_linear_blend():
    _, (task,) = inputs(1, 0.5, seed=12)
    base, other = torch.zeros(SHAPE), -task  # exactly antipodal task vectors
    params = {"weight": [1.0, 1.0], "normalize_weights": True, "eps": 1e-8}
    reference = multislerp(base, [task, other], [1.0, 1.0])
    merged, state = every_split("multislerp", params, base, [task, other], reference)
    assert state["tensors"]["w"]["linear"]
    if mk_registry is not None:
        theirs = mergekit("multislerp", [base, task, other], 0, params)
        assert within_bound(merged, theirs, [base, task, other]) == 0


def test_multislerp_keeps_a_tensor_no_task_changed():
    """Every task vector zero (an agent measured against the base at its precision changed
    nothing there): the base, where mergekit refuses the zero mean direction."""
    base, _ = inputs(1, 0.5, seed=14)
    params = {"weight": [0.6, 0.9, 0.7], "normalize_weights": True, "eps": 1e-8}
    reference = multislerp(base, [base.clone()] * 3, [0.6, 0.9, 0.7])
    merged, state = every_split("multislerp", params, base, [base.clone()] * 3, reference)
    assert state["tensors"]["w"]["unchanged"] and torch.equal(merged, base.to(torch.float32))


def test_multislerp_antipodal_three_is_an_error_naming_the_tensor():
    _, (task,) = inputs(1, 0.5, seed=13)
    base, other = torch.zeros(SHAPE), -task
    params = {"weight": [1.0, 1.0, 0.0], "normalize_weights": True, "eps": 1e-8}
    with pytest.raises(RamDistError, match="tensor 'w': the weighted sum"):
        run("multislerp", params, base, [task, other, task], [0, base.numel()])


# ---------------------------------------------------------------- karcher


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize(("max_iter", "tol"), [(10, 1e-5), (1, 1e-5), (0, 1e-5), (50, 1e-9)])
def test_karcher(n, max_iter, tol):
    _, models = inputs(n, 1.0, seed=20 + n)
    params = {"max_iter": max_iter, "tol": tol}
    reference = karcher(models, max_iter, tol)
    merged, state = every_split("karcher", params, models[0], models, reference)
    if mk_registry is not None:
        theirs = mergekit("karcher", models, None, params)
        within_bound(merged, theirs, models)


def test_karcher_of_zero_models_is_zeros_and_of_one_is_itself():
    _, models = inputs(2, 1.0, seed=30)
    zeros = [torch.zeros(SHAPE), -torch.zeros(SHAPE)]
    merged, state = every_split("karcher", {"max_iter": 10, "tol": 1e-5}, zeros[0], zeros,
                                karcher(zeros))  # fmt: skip
    assert state["tensors"]["w"]["zeros"]
    merged, _ = every_split("karcher", {"max_iter": 10, "tol": 1e-5}, models[0], models[:1],
                            karcher(models[:1]))  # fmt: skip
    assert torch.equal(merged, models[0])
    # one zero model: it adds nothing to the direction, and its norm 0 to the mean norm
    mixed = [models[0], torch.zeros(SHAPE), models[1]]
    merged, _ = every_split("karcher", {"max_iter": 10, "tol": 1e-5}, models[0], mixed,
                            karcher(mixed))  # fmt: skip
    if mk_registry is not None:
        within_bound(merged, mergekit("karcher", mixed, None, {}), mixed)


# ---------------------------------------------------------------- exact column sums


def test_column_sums_are_exact_at_any_split_and_scale():
    """nuslerp's per-column accumulator: math.fsum of each column's float64 products (each
    exact), for any split of the rows, from the smallest float32 products to the largest,
    with infinities and NaN counted as exact_sums counts them."""
    import math

    from ram_dist.methods.geometric.columns import column_sums, values

    gen = torch.Generator().manual_seed(0)
    rows, cols = 37, 11

    def scaled() -> torch.Tensor:
        exponents = torch.randint(-140, 120, (rows, cols), generator=gen).float()
        return torch.randn(rows, cols, generator=gen) * torch.exp2(exponents)

    def full(value: float) -> torch.Tensor:
        return torch.full((rows, cols), value)

    cases = [(scaled(), scaled()), (full(1e-45), full(-1e-45)), (full(3e38), full(-3e38))]
    for x, y in cases:
        want = [math.fsum((x[:, j].double() * y[:, j].double()).tolist()) for j in range(cols)]
        for cuts in ([0, rows], [0, 1, 5, 6, rows], [*range(0, rows, 4), rows]):
            total = sum(
                column_sums(x[lo:hi].reshape(-1), y[lo:hi].reshape(-1), cols)
                for lo, hi in zip(cuts, cuts[1:], strict=False)
            )
            assert values(total) == want
    x, y = scaled(), scaled()
    x[3, 2], x[0, 7] = math.inf, math.nan
    x[4, 5], y[4, 5], x[6, 5], y[6, 5] = math.inf, 1.0, 1.0, -math.inf  # inf + -inf: NaN
    got = values(column_sums(x.reshape(-1), y.reshape(-1), cols))
    assert got[2] == math.copysign(math.inf, float(y[3, 2])) and math.isnan(got[5])
    assert math.isnan(got[7]) and got[0] == math.fsum(
        (x[:, 0].double() * y[:, 0].double()).tolist()
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["slerp", "nuslerp", "nuslerp-columns", "multislerp", "karcher"])
def test_fused_statistics_are_the_eager_rules_integers(name, dtype):
    """The Gram round (nuslerp's columns: the sums per column) by the fused kernels (raw
    arrays: bf16 as its uint16 bits) gives the eager rule's integers, one for one."""
    pytest.importorskip("numba")
    name, columns = name.split("-")[0], name.endswith("columns")
    n = {"slerp": 1, "nuslerp": 2}.get(name, 3)
    base, tasks = inputs(n, 0.5, seed=40)
    base, tasks = base.to(dtype), [t.to(dtype) for t in tasks]
    params = {"slerp": {"t": 0.3}, "karcher": {"max_iter": 10, "tol": 1e-5}}.get(
        name, {"weight": [1.0] * n, "normalize_weights": True, "eps": 1e-8,
               "nuslerp_flatten": True, "nuslerp_row_wise": False}
    )  # fmt: skip
    if columns:
        params |= {"nuslerp_flatten": False, "nuslerp_row_wise": True}
    method = get_method(name)
    chunk = Chunk("w", 0, SHAPE)
    state = method.initial_state({"w": params}, {"w": base.numel()}, n)
    work = ChunkWork(chunk, params, state)
    eager = method.chunk_statistics(work, base.reshape(-1), [t.reshape(-1) for t in tasks])["w"]

    def raw(x: torch.Tensor) -> np.ndarray:
        return (
            x.reshape(-1).view(torch.uint16).numpy()
            if x.dtype == torch.bfloat16
            else x.reshape(-1).numpy()
        )

    fused, counts = method.fused_statistics(work, [raw(base), *map(raw, tasks)])
    assert counts is None and fused["w"].dtype == np.int64
    assert np.array_equal(fused["w"], eager.numpy())


def test_row_grams_by_the_kernel_and_by_the_eager_rule_agree(monkeypatch):
    """nuslerp's per-row sums: the fused kernel on the CPU, the eager rule elsewhere (a GPU);
    both are the exact sums rounded once."""
    import math

    from ram_dist.methods import exact_sums
    from ram_dist.methods.geometric.span import row_grams

    _, (x, y) = inputs(2, 1.0, seed=41)
    fused = row_grams([x.reshape(-1), y.reshape(-1)], SHAPE[1])
    monkeypatch.setattr(exact_sums, "row_gram", lambda *args: None)
    eager = row_grams([x.reshape(-1), y.reshape(-1)], SHAPE[1])
    assert fused == eager
    want = [math.fsum((x[r].double() * y[r].double()).tolist()) for r in range(SHAPE[0])]
    assert [g[0][1] for g in eager] == want
