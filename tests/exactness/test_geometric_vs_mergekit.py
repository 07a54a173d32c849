"""slerp, nuslerp, multislerp and karcher through the engine against mergekit 0.1.5 itself
(the oracle, `dtype: float32`, the same YAML read by ram-dist's reader): within the spec's
bound `2**-20 * (|theta_B| + sum_t |theta_t|)` per element, and mergekit's bytes where the
arithmetic is element-wise (slerp's linear branch); mergekit's example `gradient-slerp.yml`
on the tiny models; bad parameters refused before any work (exit 2, naming them)."""

from __future__ import annotations

import pytest
import torch
import yaml
from geometric_models import build_geometric_models
from mergekit_runs import mergekit_config, run_mergekit, run_ours
from refusals import merge_refused

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    return build_geometric_models(tmp_path_factory.mktemp("geo"))


# ---------------------------------------------------------------- against mergekit


def _within_bound(ours: dict, theirs: dict, inputs: list[dict]) -> int:
    """Every element within `2**-20 * sum |inputs|`; returns how many differ at all."""
    assert ours.keys() == theirs.keys()
    differ = 0
    for name, want in theirs.items():
        got = ours[name]
        assert got.dtype == want.dtype == torch.float32, name
        bound = 2.0**-20 * sum(x[name].float().abs() for x in inputs)
        excess = ((got - want).abs() / bound).max()
        assert ((got - want).abs() <= bound).all(), f"{name}: {float(excess)} x the bound"
        differ += int((got != want).sum())
    return differ


def test_slerp_close_to_mergekit_and_its_bytes_on_the_linear_branch(models, tmp_path):
    base_dir, task_dirs, base, tasks = models
    far = mergekit_config("slerp", base_dir, [task_dirs[1]], {"t": 0.3})
    theirs = run_mergekit(far, tmp_path / "theirs")
    assert _within_bound(run_ours(far, tmp_path / "ours")[0], theirs, [base, tasks[1]]) > 0
    near = mergekit_config("slerp", base_dir, [task_dirs[0]], {"t": 0.7})
    theirs = run_mergekit(near, tmp_path / "theirs-near")
    assert _within_bound(run_ours(near, tmp_path / "ours-near")[0], theirs, [base, tasks[0]]) == 0


@pytest.mark.parametrize(
    ("method", "params", "picked", "with_base"),
    [
        ("nuslerp", {}, [1, 2], True),
        ("nuslerp", {"nuslerp_flatten": False}, [1, 2], True),
        ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True}, [1, 2], True),
        ("multislerp", {}, [1, 2, 3], True),
        ("multislerp", {"normalize_weights": False}, [1, 2], True),
        ("karcher", {"max_iter": 20}, [0, 1, 2], False),
    ],
)
def test_close_to_mergekit(models, tmp_path, method, params, picked, with_base):
    base_dir, task_dirs, base, tasks = models
    per_model = [{"weight": w} for w in (0.6, 0.9, 0.4)][: len(picked)]
    if method == "karcher":
        per_model = None
    config = mergekit_config(
        method, base_dir if with_base else None, [task_dirs[i] for i in picked], params, per_model
    )
    inputs = [tasks[i] for i in picked] + ([base] if with_base else [])
    _within_bound(
        run_ours(config, tmp_path / "ours")[0], run_mergekit(config, tmp_path / "theirs"), inputs
    )


def test_karcher_takes_base_model_as_one_more_input_as_mergekit(models, tmp_path):
    base_dir, task_dirs, base, tasks = models
    config = mergekit_config("karcher", base_dir, task_dirs[1:])
    theirs = run_mergekit(config, tmp_path / "theirs")
    _within_bound(run_ours(config, tmp_path / "ours")[0], theirs, [base, *tasks[1:]])


def test_mergekit_example_gradient_slerp(models, tmp_path):
    """mergekit's examples/gradient-slerp.yml on the tiny models (two layers), float32."""
    base_dir, task_dirs, base, tasks = models
    config = {
        "slices": None,
        "models": [{"model": str(base_dir)}, {"model": str(task_dirs[2])}],
        "merge_method": "slerp",
        "base_model": str(base_dir),
        "parameters": {
            "t": [
                {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                {"value": 0.5},
            ]
        },
        "dtype": "float32",
    }
    del config["slices"]  # the example's equivalent `models:` form
    ours = run_ours(config, tmp_path / "ours")[0]
    _within_bound(ours, run_mergekit(config, tmp_path / "theirs"), [base, tasks[2]])
    # t = 0 (first layer's attention) is the base itself; t = 1 (last layer's) the model
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ours[name], base[name].float())
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(ours[name], tasks[2][name].float())
    # Replaying the resolved config (t per tensor) gives the same bytes again.
    effective = yaml.safe_load((tmp_path / "ours" / "mergekit_config.yml").read_text())
    replay = run_ours(effective, tmp_path / "replay")[0]
    assert all(
        torch.equal(replay[k].view(torch.int32), v.view(torch.int32)) for k, v in ours.items()
    )


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("method", "picked", "flags", "names"),
    [
        ("slerp", [1, 2], ["--t", "0.5"], "slerp merges exactly one task model"),
        ("slerp", [1], [], "parameter t is required"),
        ("nuslerp", [0, 1, 2], ["--weight", "1"], "nuslerp merges exactly two task models"),
        ("nuslerp", [1, 2], [], "parameter weight is required"),
        ("multislerp", [1, 2], ["--weight", "1", "--weight", "-1"], "parameter weight"),
        ("karcher", [1, 2], ["--max-iter", "-1"], "parameter max_iter must be >= 0"),
        ("karcher", [1, 2], ["--tol", "-0.1"], "parameter tol must be >= 0"),
    ],
)
def test_bad_parameters_are_refused_before_any_work(models, tmp_path, capsys, method, picked,
                                                     flags, names):  # fmt: skip
    base_dir, task_dirs, _, _ = models
    chosen = [task_dirs[i] for i in picked]
    line = merge_refused(capsys, base_dir, chosen, tmp_path / "out", "--method", method, *flags)
    assert names in line, line


@pytest.mark.parametrize("method", ["slerp", "nuslerp", "multislerp"])
def test_a_config_without_base_model_is_refused_for_the_methods_that_need_one(method):
    """slerp needs its base (as in mergekit); nuslerp and multislerp, which mergekit also runs
    without one (about the origin), take it here as the origin of the task vectors, so a
    config without base_model is refused by name rather than merged otherwise."""
    from ram_dist.errors import RamDistError
    from ram_dist.mergekit_config import parse_mergekit_config

    raw = {"merge_method": method, "models": [{"model": "a"}, {"model": "b"}]}
    with pytest.raises(RamDistError, match=f"{method} needs a base_model"):
        parse_mergekit_config(raw, "x.yaml")
