"""Watching a job: JSON log lines, progress counters, and a dry run that writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import shared_ray
import torch
from builders import save_checkpoint

from ram_dist.cli import main


@pytest.fixture
def inputs(tmp_path):
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    save_checkpoint(base, tmp_path / "base", max_shard_bytes=4096)
    tasks = []
    for i, p in enumerate((0.1, 0.5, 0.6)):
        state = {k: v + (torch.rand(v.shape, generator=g) < p) * 0.01 for k, v in base.items()}
        save_checkpoint(state, tmp_path / f"t{i}")
        tasks.append(tmp_path / f"t{i}")
    return tmp_path / "base", tasks


def _args(base, tasks, *extra):
    args = ["--base", str(base), *map(str, extra)]
    for t in tasks:
        args += ["--task", str(t)]
    return args


@pytest.mark.usefixtures("ray_local")
def test_json_log_lines_parse_and_progress_reaches_the_total(inputs, tmp_path):
    """The command in a process of its own (its stderr is the log), on the shared Ray."""
    base, tasks = inputs
    out = tmp_path / "out"
    env = shared_ray.joining_env()
    done = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", "merge", *_args(base, tasks, "--out", out),
         "--log-format", "json", "--unit-mb", "0.002"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "job_start" and kinds[-1] == "done"
    report = json.loads((out / "merge_report.json").read_text())
    for name, key in (("reduce 1", "reduce"), ("map", "map")):
        start = next(e for e in events if e["event"] == "pass_start" and e["name"] == name)
        progress = [e for e in events if e["event"] == "progress" and e["name"] == name]
        end = next(e for e in events if e["event"] == "pass_end" and e["name"] == name)
        assert progress[-1]["bytes_done"] == start["bytes_total"] == end["bytes_done"]
        assert start["bytes_total"] == report["passes"][key]["bytes_read"]
        assert all(
            a["bytes_done"] <= b["bytes_done"] for a, b in zip(progress, progress[1:], strict=False)
        )
    shards = [e["shard"] for e in events if e["event"] == "shard_written"]
    assert sorted(shards) == sorted(report["output"]["shards_written"])  # finished in any order
    assert events[-1]["output"] == str(out)
    assert "merged model written to" in done.stdout


def test_dry_run_and_plan_write_nothing(inputs, tmp_path, capsys):
    base, tasks = inputs
    out = tmp_path / "out"
    assert main(["merge", *_args(base, tasks, "--out", out, "--dry-run")]) == 0
    text = capsys.readouterr().out
    assert "work units:" in text and "nothing was written" in text and str(out) in text
    assert not out.exists()
    out.mkdir()
    assert main(["plan", *_args(base, tasks, "--out", out, "--log-format", "json")]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert os.listdir(out) == []
    assert planned["output"]["state"] == "new"
    assert planned["tensors"] == {"merged": 2, "copied": 0, "elements_merged": 64 * 32 + 32}
    assert planned["bytes_per_pass"]["map"] == 4 * (64 * 32 + 32) * 4
    # The catalogue's checks run in a dry run too.
    assert main(["plan", *_args(base, tasks[:1], "--out", out)]) == 2
    assert "two or more" in capsys.readouterr().err
