"""model_stock, sce, arcee_fusion, nearswap and passthrough on chunks, as the engine runs them
(reduce rounds over chunks, statistics summed, the state through JSON, then the map pass),
against the independent reference (`support/stock_reference.py`) to the byte for every
chunking, and against mergekit's own functions on whole tensors by the spec's parity rule."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import stock_reference as ref
import torch

from ram_dist.errors import RamDistError
from ram_dist.io.writer import json_text
from ram_dist.methods import float64_math, get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals

try:
    import mergekit.merge_methods.base as mk_base
    import mergekit.merge_methods.registry as mk_registry
except ImportError:  # the reference tests still run; CI installs mergekit
    if os.environ.get("CI") == "true":
        raise
    mk_base = mk_registry = None

needs_mergekit = pytest.mark.skipif(mk_registry is None, reason="mergekit (oracle) not installed")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHAPES = [(48, 37), (3, 5, 7), (61,)]


def make_inputs(n_tasks: int, shape=(48, 37), seed: int = 0, scale: float = 0.01):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    tasks = [base + scale * torch.randn(shape, generator=gen) for _ in range(n_tasks)]
    return base, tasks


def chunkings(shape: tuple[int, ...], whole_rows: bool) -> list[list[int]]:
    """Several splits of the flat tensor: whole, one row (or element) per chunk, uneven."""
    n = math.prod(shape)
    if whole_rows:
        step = math.prod(shape[1:]) if len(shape) > 1 else n
        units = list(range(0, n, step)) + [n]
        return [[0, n], units, sorted({0, n, *units[1:-1:3], *units[2:-1:5]})]
    gen = torch.Generator().manual_seed(n)
    cuts = torch.randint(1, n, (9,), generator=gen).tolist()
    return [[0, n], sorted({0, 1, 2, 3, n - 2, n - 1, n}), sorted({0, *cuts, n})]


def run(method_name: str, base, tasks, params, bounds, name: str = "w") -> tuple:
    """The engine's rounds and map pass on the chunks `bounds` cuts; (merged, state). The
    state goes through the manifest's JSON between rounds (non-finite floats as strings)."""
    method = get_method(method_name)
    shape = tuple(base.shape)
    flat = [x.reshape(-1) for x in [base, *tasks]]
    pieces = [
        (Chunk(name, lo, shape), [x[lo:hi] for x in flat])
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    numel = {name: base.numel()}
    state = method.initial_state({name: params}, numel, len(tasks))
    state = json.loads(json_text(state))  # as the manifest keeps it
    for round_ in range(method.rounds):
        if not method.active(round_, state, name):
            continue
        totals: dict[str, torch.Tensor] = {}
        for chunk, (b, *ts) in pieces:
            for key, value in method.chunk_statistics(
                ChunkWork(chunk, params, state, round_), b, ts
            ).items():
                assert value.dtype == torch.int64, key
                totals[key] = totals[key] + value if key in totals else value
        state = method.finalize(RoundTotals(round_, totals, {name: params}, numel, state))
        state = json.loads(json_text(state))  # as the manifest keeps it
    parts = [
        method.merge_chunk(ChunkWork(chunk, params, state), b, ts) for chunk, (b, *ts) in pieces
    ]
    return torch.cat([p.reshape(-1) for p in parts]).reshape(base.shape), state


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_type = a.dtype == b.dtype == torch.float32
    return same_type and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_reference(method, base, tasks, params, expected) -> dict:
    whole = method.whole_rows(params) if hasattr(method, "whole_rows") else False
    state = {}
    for bounds in chunkings(tuple(base.shape), whole):
        merged, state = run(method.name, base, tasks, params, bounds)
        assert same_bytes(merged, expected), (bounds, int((merged != expected).sum()))
    return state


CASES = [
    ("model_stock", 3, {"filter_wise": False}),
    ("model_stock", 2, {"filter_wise": False}),
    ("model_stock", 4, {"filter_wise": True}),
    ("sce", 3, {"select_topk": 1.0, "int8_mask": False}),
    ("sce", 3, {"select_topk": 0.3, "int8_mask": False}),
    ("sce", 1, {"select_topk": 0.5, "int8_mask": True}),
    ("arcee_fusion", 1, {}),
    ("nearswap", 1, {"t": 0.004}),
    ("passthrough", 1, {"scale": [1.0]}),
    ("passthrough", 1, {"scale": [-0.37]}),
]


def _reference(method: str, base, tasks, params):
    if method == "model_stock":
        return ref.model_stock(base, tasks, params["filter_wise"])
    if method == "sce":
        return ref.sce(base, tasks, params["select_topk"])
    if method == "arcee_fusion":
        return ref.arcee_fusion(base, tasks[0])
    if method == "nearswap":
        return ref.nearswap(base, tasks[0], params["t"])
    return ref.passthrough(tasks[0], params["scale"][0])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("method", "n", "params"), CASES, ids=lambda c: str(c))
def test_every_chunking_gives_the_reference_bytes(method, n, params, shape):
    base, tasks = make_inputs(n, shape, seed=n + len(shape))
    expected = _reference(method, base, tasks, params)
    assert_reference(get_method(method), base, tasks, params, expected)


# ---------------------------------------------------------------- against mergekit


def mergekit(method: str, base, tasks, **params) -> torch.Tensor:
    impl = mk_registry.get(method)
    inputs = [base, *tasks] if base is not None else tasks
    group = mk_base.TensorGroup.from_tensors(inputs, base_index=0 if base is not None else None)
    values = {s.name: s.default for s in impl.spec.parameters if s.default is not None}
    values.update(params)
    return impl.merge_group(group, **values)


def within_bound(ours, theirs, base, tasks) -> bool:
    """The spec's parity rule: |ours - mergekit| <= 2**-20 (|theta_B| + sum_t |theta_t|)."""
    bound = 2.0**-20 * (base.abs() + sum(t.abs() for t in tasks))
    return bool(((ours - theirs).abs() <= bound).all())


@needs_mergekit
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("method", "n", "params"), CASES, ids=lambda c: str(c))
def test_against_mergekit(method, n, params, shape):
    base, tasks = make_inputs(n, shape, seed=10 + n)
    ours, _ = run(method, base, tasks, params, [0, base.numel()])
    if method == "passthrough":
        theirs = mergekit(method, None, tasks, scale={0: params["scale"][0]})
    else:
        kw = {k: v for k, v in params.items() if k != "int8_mask"}
        theirs = mergekit(method, base, tasks, **kw)
    if method == "arcee_fusion":
        # a selection by mergekit's float32 KL, whose sums take an order that depends on the
        # CPU's vector width: mergekit's bytes where that KL's rounding cannot change its
        # choice, the algorithm computed exactly (the reference) everywhere
        settled = ref.arcee_settled(base, tasks[0])
        assert same_bytes(ours, ref.arcee_fusion(base, tasks[0]))
        assert same_bytes(ours[settled], theirs[settled]) and int(settled.sum()) > 0
    elif method in ("nearswap", "passthrough"):  # element-wise
        assert same_bytes(ours, theirs)
    else:
        assert within_bound(ours, theirs, base, tasks)


@needs_mergekit
def test_model_stock_with_mergekit_t_is_mergekit_bytes():
    """The map pass is mergekit's expression op by op: with mergekit's own (float32) t the
    bytes are mergekit's; ours differs from it only by the rounding of t."""
    from ram_dist.methods.model_stock import blend

    base, tasks = make_inputs(3, seed=3)
    offsets = [t.reshape(-1) - base.reshape(-1) for t in tasks]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norm = (torch.norm(a) * torch.norm(b)).clamp(min=1e-6)
            cosines.append(((a * b).sum() / norm).clamp(-1, 1))
    c = torch.stack(cosines).mean(0).unsqueeze(-1)
    t = (3 * c) / (1 + 2 * c)
    theirs = mergekit("model_stock", base, tasks)
    flat = blend(base.reshape(-1), [x.reshape(-1) for x in tasks], t)
    assert same_bytes(flat.reshape(base.shape), theirs)
    _, state = run("model_stock", base, tasks, {"filter_wise": False}, [0, base.numel()])
    assert abs(state["t"]["w"] - float(t)) <= 4 * abs(float(np.spacing(np.float32(float(t)))))


@needs_mergekit
def test_sce_selection_is_mergekit_where_no_variances_tie():
    """The variances are torch's CPU `var` to the bit, so the kept positions are mergekit's
    (its `topk` ranks the same values; they have no ties here)."""
    from ram_dist.methods.sce import variance

    base, tasks = make_inputs(4, (64, 33), seed=4)
    deltas = [t - base for t in tasks]
    ours = variance(deltas)
    assert same_bytes(ours, torch.var(torch.stack(deltas), dim=0, unbiased=False))
    params = {"select_topk": 0.25, "int8_mask": False}
    merged, state = run("sce", base, tasks, params, chunkings((64, 33), False)[2])
    theirs = mergekit("sce", base, tasks, select_topk=0.25)
    changed_ours = merged != base
    changed_theirs = theirs != base
    assert torch.equal(changed_ours, changed_theirs)  # the same positions survive
    assert state["tensors"]["w"]["k"] == int(torch.count_nonzero(ours) * 0.25)


def test_sce_cut_through_equal_variances_takes_the_lowest_indices():
    """Variances that tie at the cut (equal task vectors at many positions): the index rounds
    run, and every chunking keeps the lowest flat indices, as the reference's stable sort."""
    gen = torch.Generator().manual_seed(1)
    base = torch.zeros(40, 25)
    pattern = torch.tensor([0.5, -0.25, 0.125])[torch.randint(0, 3, (40, 25), generator=gen)]
    tasks = [base + pattern, base - pattern, base + 2 * pattern]
    params = {"select_topk": 0.37, "int8_mask": False}
    expected = ref.sce(base, tasks, 0.37)
    state = assert_reference(get_method("sce"), base, tasks, params, expected)
    info = state["tensors"]["w"]
    assert info["need"] < info["equal"] and "index_cut" in info
    assert get_method("sce").report(state)["sce"]["cuts_through_equal_variances"] == 1


def test_model_stock_singular_and_opposite_tasks():
    """Opposite task vectors: cos = -1, 1 + (N - 1) cos = 0, t = 0: the base, as mergekit."""
    base, tasks = make_inputs(1, (20, 9), seed=2)
    d = tasks[0] - base
    tasks = [base + d, base - d]
    merged, state = run("model_stock", base, tasks, {"filter_wise": False}, [0, 180])
    assert state["t"]["w"] == 0.0
    assert same_bytes(merged, ref.model_stock(base, tasks))
    assert same_bytes(merged, 0 * ((tasks[0] + tasks[1]) / 2) + (1 - torch.tensor(0.0)) * base)


def test_nearswap_edges_are_elementwise():
    """Equal values (distance floored at 1e-6), t = 0 and negative t (the base), infinities."""
    base = torch.tensor([0.0, 1.0, -2.0, 3.0, 1e-7, -0.0, math.inf, 5.0])
    task = torch.tensor([0.0, 1.0 + 2e-7, -2.5, 3.0, -1e-7, 0.0, 1.0, -math.inf])
    for t in (0.0, -0.5, 1e-7, 0.3, 10.0):
        ours, _ = run("nearswap", base, [task], {"t": t}, [0, 3, 8])
        assert same_bytes(ours, ref.nearswap(base, task, t)) or torch.equal(
            ours.isnan(), ref.nearswap(base, task, t).isnan()
        )
        if mk_registry is not None:
            theirs = mergekit("nearswap", base, [task], t=t)
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), t


def test_arcee_fusion_keys_order_every_float():
    from ram_dist.methods.arcee_fusion import key_value, order_keys

    values = torch.tensor(
        [-math.inf, -3.0, -1e-40, -0.0, 0.0, 1e-45, 1e-40, 2.5, math.inf, math.nan]
    )
    keys = order_keys(values).tolist()
    assert keys == sorted(keys) and keys[3] == keys[4]
    assert [key_value(k) for k in keys[:-1]] == [*values[:3].tolist(), 0.0, *values[4:9].tolist()]


def test_arcee_fusion_quantiles_on_a_tensor_with_equal_importances():
    """Many equal importances (rows left unchanged: importance 0) and a 1-D tensor."""
    base, tasks = make_inputs(1, (30, 16), seed=6, scale=0.05)
    task = tasks[0].clone()
    task[::2] = base[::2]  # half of the rows unchanged
    expected = ref.arcee_fusion(base, task)
    state = assert_reference(get_method("arcee_fusion"), base, [task], {}, expected)
    assert state["tensors"]["w"]["quartiles"][0] == 0.0
    vector_base, vector_tasks = make_inputs(1, (257,), seed=7, scale=0.3)
    expected = ref.arcee_fusion(vector_base, vector_tasks[0])
    assert_reference(get_method("arcee_fusion"), vector_base, vector_tasks, {}, expected)


def test_float64_exp_and_log_are_accurate():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen, dtype=torch.float64) * 40
    e = float64_math.exp(x)
    want = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    assert ((e - want).abs() <= 4 * 2.0**-52 * want).all()
    y = x.abs() + 1e-300
    got = float64_math.log(y)
    want = torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert ((got - want).abs() <= 4 * 2.0**-52 * want.abs().clamp(min=1e-300)).all()
    special = torch.tensor([0.0, -1.0, math.inf, math.nan, 5e-324], dtype=torch.float64)
    assert float64_math.log(special)[:2].tolist()[0] == -math.inf
    assert math.isnan(float64_math.log(special)[1]) and math.isnan(float64_math.log(special)[3])
    assert float64_math.log(special)[4] == pytest.approx(math.log(5e-324))
    big = torch.tensor([-800.0, 800.0, math.nan, 0.0], dtype=torch.float64)
    assert float64_math.exp(big)[:2].tolist() == [0.0, math.inf]
    assert float64_math.exp(big)[3] == 1.0


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("method", "params", "words"),
    [
        ("nearswap", {"t": None}, "parameter t is required"),
        ("sce", {"select_topk": 0.0}, "parameter select_topk must be in (0, 1]"),
        ("sce", {"select_topk": 1.5}, "parameter select_topk must be in (0, 1]"),
        ("model_stock", {"filter_wise": "yes"}, "parameter filter_wise must be true or false"),
        ("passthrough", {"scale": [math.nan]}, "parameter scale must be finite"),
    ],
)
def test_bad_parameters_are_refused_by_name(method, params, words):
    m = get_method(method)
    with pytest.raises(RamDistError, match=None) as caught:
        for p in m.parameters:
            if p.name in params:
                values = params[p.name] if p.per_task else [params[p.name]]
                for value in values:
                    p.validate(value, "tensor 'w'")
        m.check(params, "tensor 'w'")
    assert words in str(caught.value) and str(caught.value).startswith("tensor 'w'")


def test_task_counts_are_mergekits():
    counts = {name: get_method(name).task_counts for name in
              ("model_stock", "sce", "arcee_fusion", "nearswap", "passthrough")}  # fmt: skip
    assert counts == {
        "model_stock": (2, None), "sce": (1, None), "arcee_fusion": (1, 1),
        "nearswap": (1, 1), "passthrough": (1, 1),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("method", "params"),
    [("model_stock", {"filter_wise": False}), ("sce", {"select_topk": 1.0, "int8_mask": False})],
)
def test_fused_exact_sums_are_the_eager_ones_bin_for_bin(method, params, dtype):
    """The fused path's statistics (numba's kernels on the raw arrays, bfloat16 as its bits)
    are the eager torch ones, bin for bin; sce's selection's too."""
    pytest.importorskip("numba")
    base, tasks = make_inputs(3, (40, 33), seed=9)
    inputs = [x.to(dtype).reshape(-1) for x in [base, *tasks]]
    raw = [(x.view(torch.uint16) if dtype == torch.bfloat16 else x).numpy() for x in inputs]
    m = get_method(method)
    chunk = Chunk("w", 0, (40, 33))
    state = m.initial_state({"w": params}, {"w": base.numel()}, 3)
    eager = m.chunk_statistics(ChunkWork(chunk, params, state, 0), inputs[0], inputs[1:])
    fused, _ = m.fused_statistics(ChunkWork(chunk, params, state, 0), raw)
    assert eager.keys() == fused.keys()
    assert all(np.array_equal(eager[k].numpy(), fused[k]) for k in eager)
    if method == "sce":  # the selection's first round too
        selecting = {"select_topk": 0.5, "int8_mask": False}
        state = m.initial_state({"w": selecting}, {"w": base.numel()}, 3)
        work = ChunkWork(chunk, selecting, state, 0)
        eager = m.chunk_statistics(work, inputs[0], inputs[1:])
        fused, _ = m.fused_statistics(work, raw)
        assert eager.keys() == fused.keys()
        assert all(np.array_equal(eager[k].numpy(), fused[k]) for k in eager)


@pytest.mark.parametrize("method", ["model_stock", "sce", "arcee_fusion"])
def test_non_finite_inputs_survive_the_manifest(method):
    """A NaN in an input (a job with --allow-nonfinite): model_stock's t and sce's weights
    become NaN, kept in the manifest as strings, and the merge still runs; where mergekit's
    result is NaN, so is ours."""
    base, tasks = make_inputs(1 if method == "arcee_fusion" else 3, (12, 10), seed=5)
    tasks[0][3, 4] = math.nan
    params = {
        "model_stock": {"filter_wise": False}, "sce": {"select_topk": 1.0, "int8_mask": False},
        "arcee_fusion": {},
    }[method]  # fmt: skip
    merged, state = run(method, base, tasks, params, [0, 60, 120])
    if method != "arcee_fusion":  # its quartiles stay finite: NaN sorts above them
        assert "nan" in json_text(state)
    if mk_registry is not None:
        kw = {k: v for k, v in params.items() if k != "int8_mask"}
        theirs = mergekit(method, base, tasks, **kw)
        assert torch.equal(merged.isnan(), theirs.isnan())


@pytest.mark.parametrize("length", [1, 2, 7, 64, 100])
def test_tree_sums_are_pairwise_in_a_fixed_order(length):
    """Each row's sum in the fixed pairwise order (zeros padding to a power of two), which is
    how `rows.tree_sums` adds: the same float64 bits, and within a few ulps of math.fsum."""
    from ram_dist.methods import rows

    gen = torch.Generator().manual_seed(length)
    values = torch.randn(9 * length, generator=gen, dtype=torch.float64) * 1e3
    got = rows.tree_sums(values, length).tolist()
    for r, total in enumerate(got):
        row = values[r * length : (r + 1) * length].tolist()
        row += [0.0] * ((1 << (length - 1).bit_length()) - length)
        while len(row) > 1:
            half = len(row) // 2
            row = [a + b for a, b in zip(row[:half], row[half:], strict=True)]
        assert total == row[0]
        exact = math.fsum(values[r * length : (r + 1) * length].tolist())
        assert abs(total - exact) <= 8 * 2.0**-52 * float(values.abs().sum())


def test_row_gram_sums_are_fsum_ones():
    """model_stock's per-row sums by numba's row Gram kernel, read back from its bins, are
    `math.fsum`'s of the float64 products, row by row (infinities and a NaN included)."""
    pytest.importorskip("numba")
    from ram_dist.methods import rows
    from ram_dist.methods.model_stock import pairs

    gen = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-30, 30, (90 * 37,), generator=gen).float()
    vectors = [torch.randn(90 * 37, generator=gen) * scale for _ in range(3)]
    vectors[0][5], vectors[1][40], vectors[2][80] = math.inf, -math.inf, math.nan
    fast = rows.gram_rows(vectors, pairs(3), 37)
    flat = [v.double() for v in vectors]
    slow = [
        [rows.fsum((flat[i][r * 37 : r * 37 + 37] * flat[j][r * 37 : r * 37 + 37]).tolist())
         for i, j in pairs(3)]
        for r in range(90)
    ]  # fmt: skip
    assert len(fast) == 90
    for got, want in zip(fast, slow, strict=True):
        assert all(x == y or (x != x and y != y) for x, y in zip(got, want, strict=True))
