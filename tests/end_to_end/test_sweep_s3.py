"""A sweep into a bucket (moto's S3 server over HTTP, Ray workers): every variant written
through the S3 sink, the same bytes as the local sweep's, each verified where it lies."""

from __future__ import annotations

import json

import pytest
from builders import build_model_set
from s3_server import LOCATION_DEPENDENT

import ram_dist

BUCKET = "ram-dist-sweep"
SWEEP = {"methods": ["ram_plus", "ties"], "grid": {"r": [0.1, 0.2], "density": [0.5]}}


@pytest.mark.usefixtures("ray_s3")
def test_a_sweep_into_a_bucket_is_the_local_sweep(tmp_path, options, fs):
    base, tasks, _, _ = build_model_set(tmp_path / "in", base_shard="100KB")
    local = ram_dist.merge(
        base=base, tasks=tasks, out=tmp_path / "local", unit_budget_bytes=8192, **SWEEP
    )
    remote = ram_dist.merge(
        base=base, tasks=tasks, out=f"s3://{BUCKET}/sweep", storage_options=options,
        unit_budget_bytes=8192, **SWEEP,
    )  # fmt: skip
    names = [v["name"] for v in remote["variants"]]
    assert names == [v["name"] for v in local["variants"]] == [
        "ram_plus-r0.1", "ram_plus-r0.2", "ties-density0.5",
    ]  # fmt: skip
    stored = json.loads(fs.cat_file(f"{BUCKET}/sweep/sweep_report.json"))
    assert [v["name"] for v in stored["variants"]] == names
    for name in names:
        here = sorted(p.name for p in (tmp_path / "local" / name).iterdir())
        there = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/sweep/{name}", refresh=True))
        assert there == here, name
        for file in here:
            if file not in LOCATION_DEPENDENT:
                got = fs.cat_file(f"{BUCKET}/sweep/{name}/{file}")
                assert got == (tmp_path / "local" / name / file).read_bytes(), (name, file)
        checked = ram_dist.verify(f"s3://{BUCKET}/sweep/{name}", storage_options=options)
        assert checked.ok, checked.problems
