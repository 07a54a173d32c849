"""End to end: `examples/rl-agents/run.py --smoke` trains, probes, merges and evaluates.

Checks that every step ran and every number is a finite score in range; never which method
wins (that is what examples/rl-agents/RESULTS.md reports, from the full run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "rl-agents" / "run.py"
TASKS = ("add", "kv", "tool")
METHODS = ("task_arithmetic", "ties", "dare_ties", "ram", "ram_plus", "ram_plus_soft")


def test_rl_agents_smoke(tmp_path: Path) -> None:
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < 90, f"the smoke run took {wall:.0f} s (budget 90 s)"

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
