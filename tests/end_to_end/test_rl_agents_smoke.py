"""End to end: `examples/rl-agents/run.py --smoke` trains, probes, merges and evaluates.

Checks that every step ran and every number is a finite score in range; never which method
wins (that is what examples/rl-agents/RESULTS.md reports, from the full run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
SCRIPT = ROOT / "examples" / "rl-agents" / "run.py"
TASKS = ("add", "kv", "tool")
METHODS = ("task_arithmetic", "ties", "dare_ties", "ram", "ram_plus", "ram_plus_soft")


def test_rl_agents_smoke(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads((out / "results.json").read_text())
    assert (out / "RESULTS.md").is_file() and (out / "figure2.png").stat().st_size > 0
    seeds = [str(s) for s in results["plan"]["seeds"]]
    assert seeds
    models = ["base", *[f"agent-{t}" for t in TASKS], *METHODS]
    assert set(models) <= set(results["models"])
    for model in results["models"]:
        for task in TASKS:
            for seed in seeds:
                score = results["scores"][model][task][seed]
                assert isinstance(score, float) and math.isfinite(score), (model, task, seed)
                assert 0.0 <= score <= 1.0, (model, task, seed, score)

    for seed in seeds:
        root = out / f"seed{seed}"
        # The base and the agents: HF folders, bf16 weights, the same tensor names.
        names = None
        for folder in ["base", *[f"agent-{t}" for t in TASKS]]:
            config = json.loads((root / folder / "config.json").read_text())
            assert config["model_type"] == "qwen2" and config["dtype"] == "bfloat16"
            with safe_open(str(root / folder / "model.safetensors"), "pt") as f:
                keys = sorted(f.keys())
                assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
            assert names is None or keys == names
            names = keys
        # GRPO ran its steps for every task.
        for task in TASKS:
            rl = results["training"][seed]["rl"][task]
            assert len(rl["train_reward"]) == results["plan"]["rl_steps"]
            assert all(0.0 <= r <= 1.0 for r in rl["train_reward"])
        # The probe: statistics per task, and its figure.
        probe = results["probe"][seed]
        assert probe["command"].startswith("ram-dist probe ")
        assert len(probe["report"]["tasks"]) == len(TASKS)
        for row in probe["report"]["tasks"]:
            assert 0.0 <= row["density"] <= 1.0
            assert sum(row["histogram"]) == row["changed"]
        assert (root / "probe.figure2.png").stat().st_size > 0
        # Every merge: a command that ran, a merged folder with its report.
        for method in METHODS:
            info = results["merges"][seed][method]
            assert info["command"].startswith("ram-dist merge ")
            assert f"--method {method}" in info["command"]
            folder = Path(info["folder"])
            assert (folder / "merge_report.json").is_file()
            assert json.loads((folder / "merge_report.json").read_text())["method"] == method
            assert (folder / "model.safetensors").is_file()


SWEEP = ROOT / "examples" / "rl-agents" / "sweep.py"


def _sweep(out: Path, *extra: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SWEEP), "--smoke", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_regime_sweep_smoke(tmp_path: Path) -> None:
    """`sweep.py --smoke`: one point on its own, whose runs to 8 updates also save the other
    points' agents they pass, then the whole sweep in the same folder, which reuses that
    point's merges and every agent (no GRPO run again) and adds the rest and the ablations."""
    out = tmp_path / "sweep"
    _sweep(out, "--point", "lr1e-3-all8")
    one = out / "seed0" / "points" / "lr1e-3-all8" / "merged" / "ram_plus.command.json"
    first = one.stat().st_mtime_ns
    assert not (out / "seed0" / "points" / "lr1e-3-het").exists()
    agents = out / "seed0" / "lr0.001"

    def records() -> dict[str, int]:
        return {
            str(p.relative_to(agents)): p.stat().st_mtime_ns
            for p in agents.glob("agent-*/step*.job.json")
        }

    trained = records()
    _sweep(out)
    assert one.stat().st_mtime_ns == first  # the point's merges were reused, not redone
    # ... and the agents of every point were saved by the first run's GRPO runs, not trained
    # again (each agent's record written once)
    assert records() == trained

    # The sweep's records lie beside the models: a merged model holds none (a merge copies
    # its base's other files, and each merged model was scored, not given the base's score).
    merged = out / "seed0" / "points" / "lr1e-3-all8" / "merged"
    assert not list(merged.glob("*/job.json")) and not list(merged.glob("*/scores.json"))
    scored = json.loads((merged / "ram_plus.scores.json").read_text())
    assert scored["folder"] == str(merged / "ram_plus")
    res = json.loads((out / "sweep.json").read_text())
    names = [p["name"] for p in res["points"]]
    assert names == ["lr1e-3-all2", "lr1e-3-all8", "lr1e-3-het"]
    assert [s["name"] for s in res["summaries"]] == names
    for point in res["points"]:
        row = res["point"][point["name"]]["0"]
        assert set(row["agents"]) == set(TASKS)
        for t in TASKS:
            steps = json.loads(
                (
                    out
                    / "seed0"
                    / "lr0.001"
                    / f"agent-{t}"
                    / f"step{point['steps'][t]}"
                    / "training.json"
                ).read_text()
            )
            assert (
                steps["steps"] == point["steps"][t] and len(steps["train_reward"]) == steps["steps"]
            )
            assert f"agent-{t}/step{point['steps'][t]}.job.json" in trained, (point, t)
        for t, p in row["probe"].items():
            assert 0.0 <= p["density"] <= 1.0 and 0.0 <= p["unique_share"] <= 1.0, t
        assert set(row["scores"]) >= set(METHODS) | {"task_arithmetic@w=0.33"}
        for method, scores in row["scores"].items():
            assert set(scores) == set(TASKS)
            assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in scores.values()), method
            command = row["commands"][method]["command"]
            assert command.startswith("ram-dist merge ") and "--out " in command
    # The ablations ran at one point, the one the rule picked.
    ablated = [n for n in names if "ram_plus@r=0" in res["point"][n]["0"]["scores"]]
    assert len(ablated) == 1
    assert "ram_plus@eps=1e-4" in res["point"][ablated[0]]["0"]["scores"]
    md = (out / "SWEEP.md").read_text()
    assert all(f"| {n} |" in md for n in names) and f"ablations, at {ablated[0]}" in md
    assert (out / "crossover.png").stat().st_size > 0
    regime_map = json.loads((out / "regime_map.json").read_text())
    assert regime_map["smoke"] is True and len(regime_map["points"]) == 3
    for summary, point in zip(res["summaries"], regime_map["points"], strict=True):
        assert point["mean_density"] == summary["mean_density"]
        assert point["ram_plus_minus"]["ties"]["mean"] == summary["delta"]["ties"]["mean"]
