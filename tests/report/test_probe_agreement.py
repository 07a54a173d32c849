"""`probe`'s sign agreement and update sizes (`methods.agreement`), per task and per pair,
against a reference computed here from the models in memory, the same for any unit size and
worker count; and the sweep it suggests (`report.suggest`), which `plan` takes as it is, on
the command line and as YAML."""

from __future__ import annotations

import json
import shlex
from fractions import Fraction
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml
from builders import build_model_set

import ram_dist
from ram_dist.cli import main
from ram_dist.methods.parameters import EPSILON
from ram_dist.report.figures import markdown_summary
from ram_dist.report.text import format_report

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
SCHEMA = json.loads((ROOT / "ram_dist" / "report_schema.json").read_text())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base, tasks, base_state, task_states = build_model_set(tmp_path_factory.mktemp("m"))
    return base, tasks, base_state, task_states


def _reference(base_state, task_states, eps):
    """Per task: changed, shared agreeing, exact sums of |tau| (unique, shared); per pair:
    both changed, same sign. Elementwise in float64 numpy, sums as Fractions."""
    n = len(task_states)
    changed = [0] * n
    agree = [0] * n
    sums = [[Fraction(0), Fraction(0)] for _ in range(n)]
    counts = [[0, 0] for _ in range(n)]
    both = np.zeros((n, n), dtype=np.int64)
    same = np.zeros((n, n), dtype=np.int64)
    for name, b in base_state.items():
        if not b.is_floating_point():
            continue
        bb = b.float().numpy().astype(np.float64)
        taus = [t[name].float().numpy().astype(np.float64) - bb for t in task_states]
        masks = [np.abs(tau) > eps for tau in taus]
        count = sum(m.astype(np.int64) for m in masks)
        signs = [np.where(m, np.sign(tau), 0) for tau, m in zip(taus, masks, strict=True)]
        for i in range(n):
            changed[i] += int(masks[i].sum())
            for j in range(n):
                both[i, j] += int((masks[i] & masks[j]).sum())
                same[i, j] += int((masks[i] & masks[j] & (signs[i] == signs[j])).sum())
            shared = masks[i] & (count >= 2)
            others_against = sum(
                ((signs[j] != 0) & (signs[j] != signs[i])).astype(np.int64)
                for j in range(n)
                if j != i
            )
            agree[i] += int((shared & (others_against == 0)).sum())
            for k, where in enumerate((masks[i] & (count == 1), shared)):
                values = np.abs(taus[i][where]).astype(np.float32)
                sums[i][k] += sum((Fraction(float(v)) for v in values), Fraction(0))
                counts[i][k] += int(where.sum())
    return changed, agree, sums, counts, both, same


def test_agreement_is_exact_and_the_same_for_any_split(models, ray_local):
    base, tasks, base_state, task_states = models
    runs = [
        ram_dist.probe(base=base, tasks=tasks, unit_budget_bytes=size, workers=workers).data
        for size, workers in ((None, 1), (3000, 2), (50_000, 1))
    ]
    assert runs[0]["agreement"] == runs[1]["agreement"] == runs[2]["agreement"]
    report = runs[0]
    changed, agree, sums, counts, both, same = _reference(base_state, task_states, EPSILON.default)
    got = report["agreement"]
    assert [t["changed"] for t in report["tasks"]] == changed  # the reference saw every tensor
    for t, row in enumerate(got["tasks"]):
        unique, shared = counts[t]
        assert (report["tasks"][t]["unique"], report["tasks"][t]["shared"]) == (unique, shared)
        assert row["shared_agreeing"] == agree[t]
        assert row["sign_agreement"] == agree[t] / shared
        assert row["mean_abs_unique"] == float(sums[t][0] / unique)
        assert row["mean_abs_shared"] == float(sums[t][1] / shared)
        assert row["unique_to_shared_magnitude"] == float(
            (sums[t][0] / unique) / (sums[t][1] / shared)
        )
    n = len(tasks)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    assert [p["tasks"] for p in got["pairs"]] == [list(p) for p in pairs]
    for p, (i, j) in zip(got["pairs"], pairs, strict=True):
        assert (p["both_changed"], p["same_sign"]) == (both[i, j], same[i, j])
        assert p["sign_agreement"] == same[i, j] / both[i, j]
    assert 0 < sum(p["both_changed"] for p in got["pairs"])  # the models do overlap


def test_the_suggested_sweep_is_what_plan_takes(models, tmp_path, ray_local, capsys):
    base, tasks, _, _ = models
    inputs = ["--base", str(base), *[a for t in tasks for a in ("--task", str(t))]]
    assert main(["probe", *inputs]) == 0
    text = capsys.readouterr().out
    report = ram_dist.probe(base=base, tasks=tasks).data
    sweep = report["suggested_sweep"]
    assert f"to try: {sweep['command']}" in text
    assert f"why: {sweep['why']}" in text
    assert f"to try: {sweep['command']}" in format_report(report)
    assert f"- to try: `{sweep['command']}`" in markdown_summary(report)
    jsonschema.validate(json.loads(json.dumps(report)), SCHEMA)
    assert sweep["methods"][0] == "ram_plus" and len(sweep["methods"]) >= 2
    assert sweep["why"].startswith(
        f"at the nearest measured point ({report['regime']['nearest']['name']})"
    )
    words = shlex.split(sweep["command"])
    assert words[:2] == ["ram-dist", "merge"]
    out = tmp_path / "sweep"
    words[words.index("--out") + 1] = str(out)
    assert main(["plan", *words[2:]]) == 0
    planned = capsys.readouterr().out
    from_yaml = ram_dist.plan(
        config={
            "merge_method": "ram_plus",
            "base_model": str(base),
            "models": [{"model": str(t)} for t in tasks],
            **yaml.safe_load(sweep["yaml"]),
        },
        out=out,
    ).data
    names = [v["name"] for v in from_yaml["sweep"]["variants"]]
    grid = sweep["grid"]
    assert len([n for n in names if n.startswith("ram_plus-")]) == len(grid["r"]) * len(
        grid["alpha"]
    )
    assert {n.split("-")[0] for n in names} == set(sweep["methods"])
    for name in names:
        assert name in planned  # the command line plans the same variants
    assert not out.exists()  # a plan writes nothing


def _placed(deltas: dict[str, float]) -> dict:
    point = {"name": "p", "ram_plus_minus": {b: {"mean": d} for b, d in deltas.items()}}
    return {"nearest": point}


REPORT = {"base": "./b", "tasks_given": ["./t 1", "./t2"]}


def test_the_rule_takes_the_baselines_ram_plus_did_not_beat_furthest_ahead_first():
    from ram_dist.report.suggest import suggest

    got = suggest(REPORT, _placed({"ties": 0.01, "task_arithmetic": -0.05, "dare_ties": -0.06}))
    assert got["methods"] == ["ram_plus", "dare_ties", "task_arithmetic"]
    assert got["grid"] == {"r": [0.05, 0.1, 0.2], "alpha": [1, 2], "density": [0.3, 0.5, 0.7]}
    assert shlex.split(got["command"]) == [
        "ram-dist", "merge", "--base", "./b", "--task", "./t 1", "--task", "./t2",
        "--out", "./sweep", "--method", "ram_plus", "--method", "dare_ties",
        "--method", "task_arithmetic", "--grid", "r=0.05,0.1,0.2", "--grid", "alpha=1,2",
        "--grid", "density=0.3,0.5,0.7",
    ]  # fmt: skip
    assert yaml.safe_load(got["yaml"]) == {
        "sweep": {"methods": got["methods"], "grid": got["grid"]}
    }
    # Ahead of every baseline: the closest one, and no density where none takes it.
    ahead = suggest(REPORT, _placed({"ties": 0.03, "task_arithmetic": 0.01, "mean": -0.2}))
    assert ahead["methods"] == ["ram_plus", "task_arithmetic"]
    assert "density" not in ahead["grid"]
    assert "ahead of task arithmetic by 1.0 points" in ahead["why"]
    assert suggest(REPORT, None) is None


def test_float32_sums_are_exact_and_add_up_over_any_split():
    import torch

    from ram_dist.methods.agreement import float32_sum, float32_value

    tiny = float(np.float32(1.4e-45))  # the least subnormal
    values = torch.tensor([0.0, tiny, 3 * tiny, 1e-3, 0.1, 1.0, 3e38, 2.5e-39], dtype=torch.float32)
    expected = sum((Fraction(float(v)) for v in values.tolist()), Fraction(0))
    assert float32_value(float32_sum(values)) == expected
    parts = float32_sum(values[:3]) + float32_sum(values[3:])
    assert torch.equal(parts, float32_sum(values))
    assert float32_value(float32_sum(torch.tensor([1.0, float("inf")]))) == float("inf")
