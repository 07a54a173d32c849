"""breadcrumbs, breadcrumbs_ties, della and della_linear through the whole engine on a real
local Ray: byte-identical to the independent reference (`support/sparse_reference.py`) at
several unit budgets and worker counts; against mergekit 0.1.5 itself (`dtype: float32`)
by the spec's parity rule; configs shaped like mergekit's own (its docs' examples and its
tests' configs for these methods: its `examples/` has none); refusals of bad parameters.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from builders import build_model_set, load_checkpoint
from mergekit_runs import mergekit_config, run_mergekit, run_ours
from refusals import merge_refused
from sparse_reference import sparse_merge

from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("models")
    return build_model_set(root, base_dtype=torch.float32, base_shard="100KB", seed=7)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.view(torch.int32), want.view(torch.int32))


def _resolved(out: Path) -> dict:
    """Per tensor, the parameters the job resolved (its `mergekit_config.yml`)."""
    return yaml.safe_load((out / "mergekit_config.yml").read_text())


# ---------------------------------------------------------------- the engine, any split

#: Per method: its parameters and the (unit budget, workers, kernels) it runs at, and
#: whether its map pass is fused where kernels are on (della's; breadcrumbs' but with L1
#: rescaling). breadcrumbs' rounds 1-3 sum a 65536-bin row per cut and chunk, so its budgets
#: are larger.
ENGINE_CASES = {
    "breadcrumbs": dict(
        runs=[(20_000, 1, "auto"), (64_000, 2, "eager"), (64_000, 2, "auto"), (2**20, 2, "auto")],
        fused=True,
        parameters={"lambda": 0.9},
        task_parameters=(
            {"weight": 1.0, "density": 0.3, "gamma": 0.05},
            {"weight": 0.5, "density": 1.0, "gamma": 0.1},
            {"weight": 0.8, "density": 0.2, "gamma": 0.3},
        ),
    ),
    "breadcrumbs_ties": dict(
        runs=[(20_000, 1, "auto"), (64_000, 2, "auto"), (2**20, 2, "auto")],
        fused=False,
        parameters={"rescale": True},
        task_parameters=(
            {"weight": 1.0, "density": 0.3, "gamma": 0.05},
            {"weight": 0.5, "density": 0.6, "gamma": 0.0},
            {"weight": 0.8, "density": 0.2, "gamma": 0.3},
        ),
    ),
    "della": dict(
        runs=[(700, 1, "auto"), (3000, 2, "eager"), (3000, 2, "auto"), (2**20, 2, "auto")],
        fused=True,
        parameters={"seed": 4},
        task_parameters=(
            {"weight": 1.0, "density": 0.4, "epsilon": 0.3},
            {"weight": 0.5, "density": 0.66, "epsilon": 0.05},
            {"weight": 0.8, "density": 1.0},
        ),
    ),
}


@pytest.mark.parametrize("method", sorted(ENGINE_CASES))
def test_engine_is_the_reference_at_any_budget_and_worker_count(models, tmp_path, method):
    base_dir, task_dirs, base, tasks = models
    case = dict(ENGINE_CASES[method])
    runs = case.pop("runs")
    fused_map = case.pop("fused")
    per_task = case["task_parameters"]
    want = {
        name: sparse_merge(
            method,
            b,
            [t[name] for t in tasks],
            name=name,
            weights=[p["weight"] for p in per_task],
            densities=[p["density"] for p in per_task],
            gammas=[p.get("gamma", 0.01) for p in per_task],
            epsilons=[p.get("epsilon", 0.15) for p in per_task],
            rescale=case["parameters"].get("rescale"),
            lam=case["parameters"].get("lambda", 1.0),
            seed=case["parameters"].get("seed", 0),
        )  # fmt: skip
        for name, b in base.items()
    }
    digests = set()
    for budget, workers, kernels in runs:
        out = tmp_path / f"{method}-{budget}-{workers}-{kernels}"
        report = run_merge(
            MergeConfig(
                base=str(base_dir),
                tasks=tuple(map(str, task_dirs)),
                out=str(out),
                method=method,
                unit_budget_bytes=budget,
                workers=workers,
                kernels=kernels,
                **case,
            )  # fmt: skip
        ).data
        merged = load_checkpoint(out)
        for name, w in want.items():
            assert _same(merged[name], w), (budget, workers, kernels, name)
        fused = report["passes"]["map"]["fused_elements"]
        assert (fused > 0) == (fused_map and kernels == "auto"), fused
        digests.add(
            tuple(
                hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out.glob("*.safetensors"))
            )
        )
    assert len(digests) == 1
    schema = json.loads(resources.files("ram_dist").joinpath("report_schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(report)
    key = "della" if method == "della" else "breadcrumbs"
    broken = {k: v for k, v in report.items() if k != key}
    assert not jsonschema.Draft202012Validator(schema).is_valid(broken)  # the schema asks for it


# ---------------------------------------------------------------- against mergekit

W = [1.0, 0.5, 0.8]


def _value(setting, name: str) -> float:
    """A parameter's value for one tensor in a resolved `mergekit_config.yml`."""
    if not isinstance(setting, list):
        return float(setting)
    return float(next(s["value"] for s in setting if s["filter"] == name))


def _straddling(base: dict, tasks: list[dict], per_model: list[dict]) -> set[str]:
    """Tensors where equal non-zero magnitudes straddle one of breadcrumbs' cuts (mergekit's
    choice among equal magnitudes is arbitrary there), with each tensor's resolved density
    and gamma (`per_model`: the models' resolved parameters)."""
    out = set()
    for name, b in base.items():
        for t, p in zip(tasks, per_model, strict=True):
            d, g = _value(p["density"], name), _value(p.get("gamma", 0.01), name)
            mags = (t[name].float() - b.float()).abs().reshape(-1).sort(descending=True).values
            n = mags.numel()
            target = int(d * n)
            a = min(int(g * n), n - target)
            cuts = [k for k in (a, a + target) if 0 < k < n and d < 1]
            if any(mags[k - 1] == mags[k] and mags[k] != 0 for k in cuts):
                out.add(name)
    return out


@pytest.mark.parametrize(
    ("method", "densities", "gammas"),
    [
        ("breadcrumbs", [0.9, 0.9, 0.9], [0.01, 0.01, 0.01]),  # mergekit's docs example
        ("breadcrumbs_ties", [0.3, 0.5, 0.2], [0.05, 0.0, 0.3]),
    ],
)
def test_breadcrumbs_byte_identical_to_mergekit(models, tmp_path, method, densities, gammas):
    base_dir, task_dirs, base, tasks = models
    per_model = [
        {"weight": w, "density": d, "gamma": g}
        for w, d, g in zip(W, densities, gammas, strict=True)
    ]
    config = mergekit_config(method, base_dir, task_dirs, {"lambda": 0.9}, per_model)
    ours, report = run_ours(config, tmp_path / "ours")
    theirs = run_mergekit(config, tmp_path / "theirs")
    skip = _straddling(base, tasks, per_model)
    assert len(skip) <= len(base) // 4
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        if name not in skip:
            assert _same(ours[name], want), name


def test_della_density_one_is_byte_identical_to_mergekit(models, tmp_path):
    """No draw matters at density 1: mergekit's bytes (epsilon given, not read)."""
    base_dir, task_dirs, _, _ = models
    per_model = [{"weight": w, "density": 1.0, "epsilon": 0.3} for w in W]
    for method in ("della", "della_linear"):
        config = mergekit_config(method, base_dir, task_dirs, {"lambda": 0.5}, per_model)
        ours, _ = run_ours(config, tmp_path / f"{method}-ours")
        theirs = run_mergekit(config, tmp_path / f"{method}-theirs")
        assert ours.keys() == theirs.keys()
        for name, want in theirs.items():
            assert _same(ours[name], want), (method, name)


def test_mergekit_della_test_config_by_statistics(models, tmp_path):
    """mergekit's own della test config (two models, global density 0.66, epsilon 0.05,
    lambda 0.5), float32: the share of task 1's changed elements that stay changed, ours and
    mergekit's within sampling noise; and a rescaled task vector keeps its L1 norm on both
    sides (`_single_task_l1`)."""
    base_dir, task_dirs, base, tasks = models
    params = {"density": 0.66, "epsilon": 0.05, "lambda": 0.5}
    config = mergekit_config(
        "della", base_dir, task_dirs[:2], params, [{"weight": 0.6}, {"weight": 0.4}]
    )
    ours, _ = run_ours(config, tmp_path / "ours")
    theirs = run_mergekit(config, tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    shares = {}
    for side, merged in (("ours", ours), ("theirs", theirs)):
        changed = kept = 0
        for name, b in base.items():
            tau = tasks[0][name].float() - b.float()
            changed += int((tau != 0).sum())
            kept += int(((tau != 0) & (merged[name].float() != b.float())).sum())
        shares[side] = kept / changed
    assert 0.66 <= shares["ours"] <= 0.9  # kept by task 1, or changed and kept by task 2
    assert shares["ours"] == pytest.approx(shares["theirs"], abs=0.02)
    rescaled = _single_task_l1(models, tmp_path)
    assert rescaled["ours"] >= len(base) - 4 and rescaled["theirs"] >= len(base) - 4


def _single_task_l1(models, tmp_path) -> dict[str, int]:
    """della_linear of one task with weight 1 and a zero-weight second one: the merged task
    vector is task 1's rescaled one, whose L1 norm is the input's in every tensor where
    something was kept (a tensor of a few changed elements may lose them all). Per side,
    how many tensors were rescaled."""
    base_dir, task_dirs, base, tasks = models
    per_model = [
        {"weight": 1.0, "density": 0.5, "epsilon": 0.2},
        {"weight": 0.0, "density": 0.5, "epsilon": 0.2},
    ]
    config = mergekit_config("della_linear", base_dir, task_dirs[:2], None, per_model)
    merged = {
        "ours": run_ours(config, tmp_path / "l1-ours")[0],
        "theirs": run_mergekit(config, tmp_path / "l1-theirs"),
    }
    rescaled = {"ours": 0, "theirs": 0}
    for name, b in base.items():
        l1 = float((tasks[0][name].double() - b.double()).abs().sum())
        for side, m in merged.items():
            kept = float((m[name].double() - b.double()).abs().sum())
            if kept:
                assert kept == pytest.approx(l1, rel=1e-5), (side, name)
                rescaled[side] += 1
    return rescaled


#: mergekit's `examples/ties.yml` (density and weight gradients, a filter) with this file's
#: methods, the way a user moves a config from one method to another.
EXAMPLE_TASKS = [
    {"density": [1, 0.7, 0.1], "weight": 1.0, "gamma": 0.01, "epsilon": 0.05},
    {"density": 0.5, "weight": [0, 0.3, 0.7, 1], "gamma": 0.1, "epsilon": 0.2},
    {
        "density": 0.33,
        "weight": [{"filter": "mlp", "value": 0.5}, {"value": 0}],
        "gamma": 0.0,
        "epsilon": 0.3,
    },
]


@pytest.mark.parametrize("method", ["breadcrumbs_ties", "della"])
def test_mergekit_example_shape(models, tmp_path, method):
    base_dir, task_dirs, base, tasks = models
    key = "gamma" if method.startswith("breadcrumbs") else "epsilon"
    drop = "epsilon" if key == "gamma" else "gamma"
    per_model = [{k: v for k, v in p.items() if k != drop} for p in EXAMPLE_TASKS]
    config = mergekit_config(
        method, base_dir, task_dirs, {"normalize": True, "int8_mask": True}, per_model
    )
    ours, _ = run_ours(config, tmp_path / "ours")
    resolved = _resolved(tmp_path / "ours")
    assert resolved["merge_method"] == method
    # The resolved config, replayed, gives the same bytes (per tensor values included).
    again, _ = run_ours(resolved, tmp_path / "again", unit_budget_bytes=1 << 20, workers=1)
    for name, got in ours.items():
        assert _same(again[name], got), name
    if method == "della":
        return  # random masks: the engine-vs-reference test covers della's bytes
    theirs = run_mergekit(config, tmp_path / "theirs")
    skip = _straddling(base, tasks, [m["parameters"] for m in resolved["models"]])
    assert len(skip) <= len(base) // 4
    for name, want in theirs.items():
        if name not in skip:
            assert _same(ours[name], want), name


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("method", "flags", "line", "cited"),
    [
        ("della_linear", ["--della-epsilon", "0.1", "--seed", "2"], "della seed: 2",
         "Deep et al. 2024"),
        ("breadcrumbs", ["--gamma", "0.1"], "breadcrumbs cuts through equal magnitudes: ",
         "Davari and Belilovsky 2023"),
    ],
)  # fmt: skip
def test_the_command_prints_the_report_and_the_card_cites(models, tmp_path, capsys, method,
                                                          flags, line, cited):  # fmt: skip
    from ram_dist.cli import main

    base_dir, task_dirs, _, _ = models
    out = tmp_path / "out"
    argv = ["merge", "--base", str(base_dir), "--out", str(out), "--method", method]
    argv += [a for t in task_dirs for a in ("--task", str(t))] + ["--density", "0.5", *flags]
    assert main(argv) == 0
    assert line in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert f"(`{method}`)" in card and cited in card


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--method", "della", "--density", "0.66", "--della-epsilon", "1.35"],
            "parameter epsilon must keep",
        ),
        (
            ["--method", "della_linear", "--density", "0.2", "--della-epsilon", "0.2"],
            "epsilon < 0.2",
        ),
        (
            ["--method", "della", "--density", "0.5", "--della-epsilon", "-0.1"],
            "epsilon must be >= 0",
        ),
        (["--method", "della", "--density", "0"], "density must be in (0, 1]"),
        (["--method", "breadcrumbs", "--density", "1.5"], "density must be in (0, 1]"),
        (["--method", "breadcrumbs", "--gamma", "1.5"], "gamma must be in [0, 1]"),
        (["--method", "breadcrumbs_ties", "--gamma", "-0.01"], "gamma must be in [0, 1]"),
        (["--method", "ties", "--gamma", "0.1"], "gamma"),
    ],
)
def test_bad_parameters_are_refused_before_any_work(models, tmp_path, capsys, extra, message):
    base_dir, task_dirs, _, _ = models
    line = merge_refused(capsys, base_dir, task_dirs, tmp_path / "out", *extra)
    assert message in line, line
