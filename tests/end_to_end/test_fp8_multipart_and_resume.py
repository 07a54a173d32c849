"""FP8 shards of several S3 parts, bucket to bucket, and a merge killed inside an FP8 shard
and resumed with another unit budget: the same bytes as the spec's reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import load_checkpoint
from fp8_models import LARGE_BLOCK, LARGE_WEIGHTS, build_fp8_set
from fp8_reference import reference_fp8_merge
from killing import env_without_ray, kill_after_first_shard, manifest_or_none

from ram_dist import api
from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

BUCKET = "ram-dist-fp8"


@pytest.fixture(scope="module")
def large(tmp_path_factory, fs) -> dict:
    """An FP8 base with 128 x 128 blocks, an FP8 agent and a bf16 agent (3 shards each of
    about 6 MiB in FP8), also uploaded to the bucket; and the reference merge."""
    root = tmp_path_factory.mktemp("fp8-large")
    s = build_fp8_set(
        root, task_formats=("fp8", "bf16"), densities=(0.1, 0.4), weights=LARGE_WEIGHTS,
        block=LARGE_BLOCK, shards=3,
    )  # fmt: skip
    for d in [s.base_dir, *s.task_dirs]:
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    expected, _ = reference_fp8_merge(s.base, s.tasks, "ram_plus", LARGE_BLOCK)
    return {"set": s, "expected": expected, "root": root}


def _same(folder: Path, expected: dict) -> None:
    got = load_checkpoint(folder)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        a = got[name].contiguous().reshape(-1).view(torch.uint8)
        b = want.contiguous().reshape(-1).view(torch.uint8)
        assert got[name].dtype == want.dtype and torch.equal(a, b), name


@pytest.mark.usefixtures("ray_s3")
def test_bucket_to_bucket_in_several_parts(large, options, fs, tmp_path):
    s = large["set"]
    config = MergeConfig(
        base=f"s3://{BUCKET}/in/base",
        tasks=tuple(f"s3://{BUCKET}/in/{d.name}" for d in s.task_dirs),
        out=f"s3://{BUCKET}/out",
        storage_options=options,
        unit_budget_bytes=1 << 20,
    )
    report = run_merge(config).data
    m = report["passes"]["map"]
    assert m["output_path"] == "direct" and m["bytes_written_by_driver"] == 0
    manifest = json.loads(fs.cat_file(f"{BUCKET}/out/ram_dist_manifest.json"))
    assert any(len(shard["parts"]) > 1 for shard in manifest["shards"].values())
    fs.get(f"{BUCKET}/out", str(tmp_path / "out"), recursive=True)
    _same(tmp_path / "out", large["expected"])
    assert api.verify(f"s3://{BUCKET}/out", storage_options=options).ok


def test_killed_inside_an_fp8_shard_resumes_with_identical_bytes(large, options, server, tmp_path):
    """Inputs read from the S3 server with 50 ms a GET and no input cache, so the map pass
    lasts long enough to be killed inside a shard (a local merge is over too soon)."""
    s = large["set"]
    out = tmp_path / "out"
    args = ["merge", "--base", f"s3://{BUCKET}/in/base", "--out", str(out)]
    for t in s.task_dirs:
        args += ["--task", f"s3://{BUCKET}/in/{t.name}"]
    args += ["--storage-options", json.dumps(options)]
    # One band a unit (the budget is less than a band), one unit at a time.
    server.get_delay_s = 0.05
    try:
        manifest = kill_after_first_shard(
            [*args, "--unit-mb", "0.1", "--workers", "1", "--input-cache", "off"],
            env_without_ray(),
            lambda: manifest_or_none((out / "ram_dist_manifest.json").read_text),
            mid_shard=True,
            out=out,
        )
    finally:
        server.get_delay_s = 0.0
    assert any(w["parts"] for w in manifest["writing"].values())
    # Resumed with the default budget: the recorded parts are kept, cut at whole bands.
    done = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", *args], env=env_without_ray(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "merge_report.json").read_text())
    assert report["passes"]["reduce"]["skipped"] is True
    assert report["passes"]["map"]["parts_reused"] >= 1
    _same(out, large["expected"])
    assert api.verify(out).ok
