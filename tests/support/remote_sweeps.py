"""A small sweep into a bucket or container and the same sweep into a local folder: what the
GCS and Azure sweep tests share (each starts its own emulator and Ray)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builders import build_model_set
from s3_server import LOCATION_DEPENDENT

import ram_dist

#: Two RAM+ variants (one count) and a TIES variant (its own rounds): three outputs.
SWEEP = {"methods": ["ram_plus", "ties"], "grid": {"r": [0.1, 0.2], "density": [0.5]}}
NAMES = ["ram_plus-r0.1", "ram_plus-r0.2", "ties-density0.5"]


def check_remote_sweep(tmp_path: Path, out: str, options: dict, fs: Any, path: str) -> dict:
    """Sweep local inputs into `out` (`path`: the same for `fs`) and into a local folder:
    the same variants, files and bytes (those naming no location), the sweep's report where
    it lies, every variant's parts written by the workers, and every variant verified there.
    Returns the remote sweep's report."""
    base, tasks, _, _ = build_model_set(tmp_path / "in", base_shard="100KB")
    local = ram_dist.merge(
        base=base, tasks=tasks, out=tmp_path / "local", unit_budget_bytes=8192, **SWEEP
    )
    remote = ram_dist.merge(
        base=base, tasks=tasks, out=out, storage_options=options, unit_budget_bytes=8192,
        **SWEEP,
    )  # fmt: skip
    assert [v["name"] for v in remote["variants"]] == [v["name"] for v in local["variants"]]
    assert [v["name"] for v in remote["variants"]] == NAMES
    stored = json.loads(fs.cat_file(f"{path}/sweep_report.json"))
    assert [v["name"] for v in stored["variants"]] == NAMES
    for name in NAMES:
        here = sorted(p.name for p in (tmp_path / "local" / name).iterdir())
        there = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{name}"))
        assert there == here, name
        for file in here:
            if file not in LOCATION_DEPENDENT:
                got = fs.cat_file(f"{path}/{name}/{file}")
                assert got == (tmp_path / "local" / name / file).read_bytes(), (name, file)
        report = json.loads(fs.cat_file(f"{path}/{name}/merge_report.json"))
        m = report["passes"]["map"]  # the workers wrote every variant's parts
        assert m["output_path"] == "direct" and m["bytes_written_by_driver"] == 0, m
        assert m["bytes_written_by_workers"] > 0
        checked = ram_dist.verify(f"{out}/{name}", storage_options=options)
        assert checked.ok, checked.problems
    return remote.data
