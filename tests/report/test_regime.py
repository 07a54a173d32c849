"""`ram-dist probe` places the user's agents on the map measured by the regime sweep of
examples/rl-agents: the nearest point by density and unique share, in one sentence that cites
the measurement, in the text output, the Markdown summary and the JSON.

The shipped map is the full sweep's own output (a copy kept equal to the example's file),
never a smoke run's."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from builders import build_model_set

from ram_dist.cli import main
from ram_dist.report import regime
from ram_dist.report.figures import markdown_summary
from ram_dist.report.text import format_report

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
EXAMPLE_MAP = ROOT / "examples" / "rl-agents" / "regime_map.json"
SCHEMA = json.loads((ROOT / "ram_dist" / "report_schema.json").read_text())


def _delta(mean: float, ahead: int) -> dict:
    return {"mean": mean, "sd": 0.01, "ahead": ahead, "n": 3}


def _point(name: str, density: float, unique: float, ties: float, learned: bool = True) -> dict:
    return {
        "name": name,
        "lr": 1e-6,
        "steps": {"add": 10, "kv": 10, "tool": 10},
        "mean_density": density,
        "mean_unique_share": unique,
        "learned": learned,
        "seeds": 3,
        "ram_plus_minus": {
            "ties": _delta(ties, 3 if ties > 0 else 0),
            "task_arithmetic": _delta(-0.02, 0),
            "mean": _delta(0.01, 2),
        },
    }


HAND_MAP = {
    "model": "a hand-made map",  # the sentence reads "... with a hand-made map: ..."
    "smoke": False,
    "points": [
        _point("sparse", 0.05, 0.40, 0.031),
        _point("middle", 0.45, 0.20, -0.012, learned=False),
        _point("dense", 0.90, 0.01, -0.044),
    ],
}


def _probe_report(densities: list[float], unique_shares: list[float]) -> dict:
    changed = [int(1000 * d) for d in densities]
    return {
        "method": "ram_plus",
        "tasks": [
            {"density": d, "changed": c, "unique": round(c * u)}
            for d, c, u in zip(densities, changed, unique_shares, strict=True)
        ],
    }


def test_the_nearest_point_and_its_numbers_are_in_the_sentence():
    placed = regime.place(_probe_report([0.05, 0.07, 0.06], [0.4, 0.3, 0.35]), HAND_MAP)
    assert placed["density"] == pytest.approx(0.06)
    assert placed["unique_share"] == pytest.approx(0.35)
    assert placed["nearest"]["name"] == "sparse" and placed["within_measured_range"]
    s = placed["sentence"]
    assert "6.0% of the weights" in s and "35.0% of each one's changes" in s
    assert "nearest point of the regime sweep in examples/rl-agents/RESULTS.md is sparse" in s
    assert "+3.1 points against TIES (ahead in 3 of 3 seeds)" in s
    assert "-2.0 points against task arithmetic (ahead in 0 of 3 seeds)" in s
    assert "+1.0 points against the plain mean (ahead in 2 of 3 seeds)" in s
    assert "with a hand-made map" in s and "not a forecast for yours" in s
    assert "outside" not in s and "not every agent learned" not in s


def test_a_point_where_agents_did_not_learn_and_a_place_outside_the_map_say_so():
    middle = regime.place(_probe_report([0.44, 0.46], [0.2, 0.2]), HAND_MAP)
    assert middle["nearest"]["name"] == "middle"
    assert "; not every agent learned its task there)" in middle["sentence"]
    assert "-1.2 points against TIES" in middle["sentence"]
    far = regime.place(_probe_report([0.99, 0.99], [0.0, 0.0]), HAND_MAP)
    assert far["nearest"]["name"] == "dense" and not far["within_measured_range"]
    assert "RESULTS.md (your agents lie outside the range it measured) is dense" in far["sentence"]


def test_reports_without_rams_statistics_are_not_placed():
    assert regime.place({"method": "ties", "ties": {}}, HAND_MAP) is None


def test_the_shipped_map_is_the_full_sweeps_own():
    shipped = regime.measured_map()
    assert EXAMPLE_MAP.is_file(), "examples/rl-agents/regime_map.json (the sweep's output)"
    assert shipped == json.loads(EXAMPLE_MAP.read_text())
    assert shipped["smoke"] is False
    assert len(shipped["points"]) >= 9
    for p in shipped["points"]:
        assert p["seeds"] == 3, p["name"]
        assert 0.0 <= p["mean_density"] <= 1.0 and 0.0 <= p["mean_unique_share"] <= 1.0
        for b in ("ties", "task_arithmetic", "mean", "dare_ties", "ram"):
            assert p["ram_plus_minus"][b]["n"] == 3, (p["name"], b)
    densities = [p["mean_density"] for p in shipped["points"]]
    assert min(densities) < 0.10 < 0.5 < max(densities)  # the paper's range and the dense one


def test_probe_says_where_the_agents_stand(tmp_path, ray_local, capsys):
    base, tasks, _, _ = build_model_set(tmp_path / "m")
    inputs = ["--base", str(base), *[a for t in tasks for a in ("--task", str(t))]]
    json_path = tmp_path / "probe.json"
    assert main(["probe", *inputs, "--json", str(json_path)]) == 0
    text = capsys.readouterr().out
    report = json.loads(json_path.read_text())
    jsonschema.validate(report, SCHEMA)
    placed = report["regime"]
    expected = regime.place(report)
    assert placed == json.loads(json.dumps(expected))
    densities = [t["density"] for t in report["tasks"]]
    assert placed["density"] == pytest.approx(sum(densities) / len(densities))
    assert f"where your agents stand: {placed['sentence']}" in text
    assert f"- where your agents stand: {placed['sentence']}" in markdown_summary(report)
    assert placed["sentence"] in format_report(report)
