"""model_stock, sce, arcee_fusion, nearswap and passthrough through the engine against
mergekit itself (the oracle, LGPL, test-time only) on the same tiny float32 checkpoints and
the same YAML plus `dtype: float32`, by the spec's parity rule; mergekit's own configs for
these methods adapted to the tiny models; and the refusals, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from builders import build_model_set, save_checkpoint
from mergekit_runs import mergekit_config, run_mergekit, run_ours
from refusals import merge_refused

mergekit = pytest.importorskip("mergekit", reason="mergekit is the oracle of these tests")
pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("models")
    return build_model_set(
        root, base_dtype=torch.float32, densities=(0.9, 0.5, 1.0), base_shard="100KB", seed=4
    )


@pytest.fixture(scope="module")
def moved(models, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A task that moved every weight by 0.1 N(0, 1): its rows' KL divergences (about
    1e-3) stand far above float32's rounding, where mergekit's float32 KL is accurate."""
    base_dir, _, base, _ = models
    gen = torch.Generator().manual_seed(11)
    state = {n: b + 0.1 * torch.randn(b.shape, generator=gen) for n, b in sorted(base.items())}
    folder = tmp_path_factory.mktemp("moved") / "moved"
    save_checkpoint(state, folder, copy_from=base_dir)
    return folder, state


def _same_bytes(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype, name
        bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        same = torch.equal(got.view(bits), want.view(bits))
        assert same, f"{name}: {int((got != want).sum())} elements differ"


def _within_bound(ours: dict, theirs: dict, base: dict, tasks: list[dict]) -> int:
    """The spec's rule, |ours - mergekit| <= 2**-20 (|theta_B| + sum_t |theta_t|) per
    element; returns how many elements differ at all."""
    assert ours.keys() == theirs.keys()
    differ = 0
    for name, want in theirs.items():
        bound = 2.0**-20 * (base[name].abs() + sum(t[name].abs() for t in tasks))
        assert ((ours[name] - want).abs() <= bound).all(), name
        differ += int((ours[name] != want).sum())
    return differ


@pytest.mark.parametrize(
    ("method", "n", "params"),
    [
        ("model_stock", 3, None),
        ("sce", 3, {"select_topk": 0.4}),
    ],
)
def test_within_the_rounding_of_the_factors(models, tmp_path, method, n, params):
    base_dir, task_dirs, base, tasks = models
    config = mergekit_config(method, base_dir, task_dirs[-n:], params)
    ours = run_ours(config, tmp_path / "ours")[0]
    theirs = run_mergekit(config, tmp_path / "theirs")
    _within_bound(ours, theirs, base, tasks[-n:])


def test_nearswap_is_byte_identical_to_mergekit(models, tmp_path):
    base_dir, task_dirs, _, _ = models
    config = mergekit_config("nearswap", base_dir, task_dirs[1:2], {"t": 0.002})
    _same_bytes(run_ours(config, tmp_path / "ours")[0], run_mergekit(config, tmp_path / "theirs"))


@pytest.fixture(scope="module")
def moved_reference(models, moved) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per tensor of the `moved` task onto the base: mergekit's arcee_fusion computed exactly
    (the reference, `stock_reference.arcee_fusion`, float32), and where the rounding of
    mergekit's own float32 KL cannot change its choice (`arcee_settled`)."""
    import stock_reference as ref

    base, task = models[2], moved[1]
    return {
        name: (ref.arcee_fusion(base[name], task[name]), ref.arcee_settled(base[name], task[name]))
        for name in base
    }


def _arcee_parity(ours: dict, theirs: dict, base: dict, reference: dict) -> tuple[int, int]:
    """arcee_fusion against mergekit, whose KL is float32 arithmetic whose sums take an order
    that depends on the CPU's vector width: ours is mergekit's algorithm computed exactly at
    every element, and mergekit's bytes wherever the rounding of its KL cannot change its
    choice (`reference`: `moved_reference`). Returns how many elements that rounding could
    change, and how many settled ones took the task's value (where the bytes say something
    of the selection)."""
    assert ours.keys() == theirs.keys() == reference.keys()
    undecided, taken = 0, 0
    for name, want in theirs.items():
        exact, settled = reference[name]
        exact = exact.to(want.dtype)
        _same_bytes({name: ours[name]}, {name: exact})
        bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        got, theirs_bits = ours[name].view(bits), want.view(bits)
        differ = int((got[settled] != theirs_bits[settled]).sum())
        assert differ == 0, f"{name}: {differ} settled elements differ from mergekit's"
        undecided += int((~settled).sum())
        taken += int((settled & (exact != base[name].to(want.dtype))).sum())
    return undecided, taken


def test_arcee_fusion_is_byte_identical_where_its_kl_is_above_float32_rounding(
    models, moved, moved_reference, tmp_path
):
    """A selection: where mergekit's float32 KL is accurate (and no tensor has over 1M
    elements, so mergekit sorts them all rather than a sample), every element whose choice
    that KL's rounding cannot change is mergekit's byte for byte (over 99 % of them here,
    thousands taking the task's value); every element is the exact algorithm's."""
    config = mergekit_config("arcee_fusion", models[0], [moved[0]])
    ours = run_ours(config, tmp_path / "ours")[0]
    theirs = run_mergekit(config, tmp_path / "theirs")
    undecided, taken = _arcee_parity(ours, theirs, models[2], moved_reference)
    assert undecided <= 0.01 * sum(t.numel() for t in theirs.values()) and taken > 1000


def test_arcee_fusion_differs_from_mergekit_where_its_float32_kl_is_rounding(models, tmp_path):
    """Agents that changed weights by ~1e-4: rows' KL divergences of ~1e-7, the size of
    float32's rounding of mergekit's sum of p log(p / q). mergekit's KL is then off by tens
    of percent, ours is the float64 value rounded once (within an ulp of the exact KL), so
    the two select differently near the threshold; each output element is still the base's
    or the task's value, and ours is the reference's."""
    import stock_reference as ref
    import torch.nn.functional as F

    base_dir, task_dirs, base, tasks = models
    config = mergekit_config("arcee_fusion", base_dir, task_dirs[1:2])
    ours = run_ours(config, tmp_path / "ours")[0]
    theirs = run_mergekit(config, tmp_path / "theirs")
    name = "lm_head.weight"
    a, b = base[name], tasks[1][name]
    assert torch.equal(ours[name], ref.arcee_fusion(a, b))
    assert bool(((ours[name] == a) | (ours[name] == b)).all())
    assert bool(((theirs[name] == a) | (theirs[name] == b)).all())
    assert int((ours[name] != theirs[name]).sum()) > 0
    p, q = F.softmax(b, dim=-1) + 1e-8, F.softmax(a, dim=-1) + 1e-8
    kl_mergekit = torch.sum(p * torch.log(p / q), dim=-1).double()
    pairs = list(zip(a.tolist(), b.tolist(), strict=True))
    ours_kl = torch.tensor([ref.arcee_kl(x, y) for x, y in pairs], dtype=torch.float64)
    exact = torch.tensor([ref.arcee_kl_float64(x, y) for x, y in pairs], dtype=torch.float64)
    assert float(((ours_kl - exact).abs() / exact).max()) <= 2.0**-24
    assert float(((kl_mergekit - exact).abs() / exact).median()) > 1e-2


def test_passthrough_with_a_scale_per_layer_is_mergekit(models, tmp_path):
    """One model, no base_model (the model gives the layout), a scale by filter."""
    _, task_dirs, _, _ = models
    scale = [{"filter": "down_proj", "value": 0.5}, {"filter": "embed", "value": -2.0},
             {"value": 1.0}]  # fmt: skip
    config = mergekit_config("passthrough", None, task_dirs[:1], None, [{"scale": scale}])
    ours = run_ours(config, tmp_path / "ours")[0]
    _same_bytes(ours, run_mergekit(config, tmp_path / "theirs"))
    # The written config, each tensor's scale resolved, gives the same model again.
    effective = yaml.safe_load((tmp_path / "ours" / "mergekit_config.yml").read_text())
    _same_bytes(run_ours(effective, tmp_path / "replay")[0], ours)


# ---------------------------------------------------------------- mergekit's own configs
# examples/arcee_fusion.yml; model_stock, sce and nearswap as mergekit's tests configure them
# (in its test_basic_merges: its examples/ folder has none for them).


def test_mergekit_example_arcee_fusion(models, moved, moved_reference, tmp_path):
    """examples/arcee_fusion.yml: the base also listed under models, dtype bfloat16. ram-dist
    computes in float32 and writes bfloat16 (its note says so): mergekit's result with
    dtype float32 and out_dtype bfloat16, to the byte where its KL's rounding cannot change
    its choice; the exact algorithm's everywhere."""
    base_dir = models[0]
    config = {
        "models": [{"model": str(base_dir)}, {"model": str(moved[0])}],
        "merge_method": "arcee_fusion",
        "base_model": str(base_dir),
        "dtype": "bfloat16",
    }
    ours = run_ours(config, tmp_path / "ours")[0]
    theirs = run_mergekit(config | {"dtype": "float32", "out_dtype": "bfloat16"}, tmp_path / "mk")
    undecided, taken = _arcee_parity(ours, theirs, models[2], moved_reference)
    assert undecided <= 0.01 * sum(t.numel() for t in theirs.values()) and taken > 1000


@pytest.mark.parametrize("filter_wise", [False, True])
def test_mergekit_example_model_stock(models, tmp_path, filter_wise):
    base_dir, task_dirs, base, tasks = models
    params = {"filter_wise": True} if filter_wise else None
    config = mergekit_config("model_stock", base_dir, task_dirs[:2], params)
    ours = run_ours(config, tmp_path / "ours")[0]
    theirs = run_mergekit(config, tmp_path / "theirs")
    assert _within_bound(ours, theirs, base, tasks[:2]) > 0  # t's rounding really differs


def test_mergekit_examples_sce_and_nearswap(models, tmp_path):
    base_dir, task_dirs, base, tasks = models
    # sce: base_model model_c, models a and b, select_topk 0.5
    config = mergekit_config("sce", task_dirs[2], [base_dir, task_dirs[0]], {"select_topk": 0.5})
    ours = run_ours(config, tmp_path / "sce")[0]
    theirs = run_mergekit(config, tmp_path / "sce-mk")
    _within_bound(ours, theirs, tasks[2], [base, tasks[0]])
    # nearswap: models a and b, base_model a, t 0.0001
    config = mergekit_config("nearswap", base_dir, [base_dir, task_dirs[0]], {"t": 0.0001})
    _same_bytes(run_ours(config, tmp_path / "near")[0], run_mergekit(config, tmp_path / "near-mk"))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("method", "n", "extra", "words"),
    [
        ("model_stock", 1, [], "model_stock merges two or more task models"),
        ("nearswap", 2, ["--nearswap-t", "0.1"], "nearswap merges exactly one task model"),
        ("arcee_fusion", 2, [], "arcee_fusion merges exactly one task model"),
        ("passthrough", 2, [], "passthrough merges exactly one task model"),
        ("nearswap", 1, [], "parameter t is required"),
        ("sce", 2, ["--select-topk", "0"], "parameter select_topk must be in (0, 1]"),
        ("sce", 2, ["--select-topk", "1.5"], "parameter select_topk must be in (0, 1]"),
        ("passthrough", 1, ["--scale", "nan"], "parameter scale must be finite"),
    ],
)
def test_refused_before_any_work(models, tmp_path, capsys, method, n, extra, words):
    base_dir, task_dirs, _, _ = models
    line = merge_refused(
        capsys, base_dir, task_dirs[:n], tmp_path / "out", "--method", method, *extra
    )
    assert words in line, line
