"""Workers write the output themselves: S3 parts, ranges of a local file; the fallback streams
through the driver. Real Ray, moto's S3 server over HTTP, bytes checked against the reference.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
import torch
from builders import build_model_set, load_checkpoint, merge_config
from reference import reference_merge

from ram_dist.api import run_merge, run_plan
from ram_dist.engine.pool import unordered_map
from ram_dist.io.sinks import shard_digest
from ram_dist.io.storage import Storage
from ram_dist.io.verify import verify
from ram_dist.planning.config import MergeConfig

BUCKET = "direct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"base": base_dir, "tasks": task_dirs, "expected": expected}


def _merge(base, tasks, out, options=None, **kw) -> dict:
    return run_merge(merge_config(base, tasks, out, options, **kw)).data


def _written_by_this_process() -> int:
    """Bytes this process (the driver) passed to write calls so far: /proc/self/io's wchar."""
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["wchar"])


@pytest.mark.usefixtures("ray_s3")
@pytest.mark.parametrize("unit_budget_bytes", [4096, 100_000, None])
def test_local_output_is_written_by_the_workers(tiny, tmp_path, unit_budget_bytes):
    out = tmp_path / "out"
    report = _merge(tiny["base"], tiny["tasks"], out, unit_budget_bytes=unit_budget_bytes)
    m = report["passes"]["map"]
    shards = sorted(out.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    assert m["output_path"] == "direct" and "one-node cluster" in m["output_path_reason"]
    assert m["bytes_written_by_driver"] == 0
    assert m["bytes_written_by_workers"] == m["bytes_written"] == total
    assert m["parts"] >= len(shards) and m["parts_reused"] == 0
    assert not list(out.glob("*.ram-dist-partial"))
    merged = load_checkpoint(out)
    assert all(torch.equal(merged[k], v) for k, v in tiny["expected"].items())
    assert verify(str(out), Storage()) == ([], len(shards))


@pytest.mark.usefixtures("ray_s3")
def test_driver_writes_no_data_on_the_direct_path(big, tmp_path):
    before = _written_by_this_process()
    report = _merge(big["base"], big["tasks"], tmp_path / "out", unit_budget_bytes=2**20)
    written = _written_by_this_process() - before
    total = report["passes"]["map"]["bytes_written"]
    assert total > 20 * 2**20
    assert written < total / 10, (written, total)  # manifest, report, card, task messages
    merged = load_checkpoint(tmp_path / "out")
    assert all(torch.equal(merged[k], v) for k, v in big["expected"].items())


@pytest.mark.usefixtures("ray_s3")
def test_s3_output_is_uploaded_in_parts_by_the_workers(big, options, fs, server, tmp_path):
    _merge(big["base"], big["tasks"], tmp_path / "local", unit_budget_bytes=2**20)
    server.clear()
    # (This process also runs the S3 server, so its I/O counters count what the server sends:
    # the local test above reads them; here the report and the server's log speak.)
    report = _merge(*big["s3"], f"s3://{BUCKET}/out", options, unit_budget_bytes=2**20)
    m = report["passes"]["map"]
    assert m["output_path"] == "direct" and m["bytes_written_by_driver"] == 0
    assert m["bytes_written_by_workers"] == m["bytes_written"]

    manifest = json.loads(fs.cat_file(f"{BUCKET}/out/ram_dist_manifest.json"))
    assert manifest["writing"] == {}
    assert min(s["size"] for s in manifest["shards"].values()) < 2**16  # one small tensor
    uploads = server.uploaded_parts()
    checksums = {(s.path, n): s.checksum for s, n in server.part_requests()}
    for name, shard in manifest["shards"].items():
        local = (tmp_path / "local" / name).read_bytes()
        assert fs.cat_file(f"{BUCKET}/out/{name}") == local
        parts = shard["parts"]
        assert len(parts) >= 2 if shard["size"] > 10 * 2**20 else len(parts) == 1
        assert all(p["stop"] - p["start"] >= 5 * 2**20 for p in parts[:-1])
        assert sorted(n for path, n in uploads if path.endswith(name)) == list(
            range(1, len(parts) + 1)
        )  # each part uploaded once, by a worker
        # ... with its SHA-256, which S3 checks against the body (BadDigest on a mismatch;
        # moto records it without checking).
        for number, p in enumerate(parts, 1):
            sent = checksums[(f"/{BUCKET}/out/{name}", number)]
            assert sent is not None and base64.b64decode(sent).hex() == p["sha256"]
        # The recorded digest is S3's own composite checksum of the object.
        bucket, key = BUCKET, f"out/{name}"
        head = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        composite = base64.b64encode(bytes.fromhex(shard["digest"])).decode()
        assert head["ChecksumSHA256"].split("-")[0] == composite  # S3 adds "-N"; moto not
        assert shard["digest"] == shard_digest([p["sha256"] for p in parts])
    assert verify(f"s3://{BUCKET}/out", Storage(options)) == ([], len(manifest["shards"]))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> dict:
    """A bf16 base with a float32, a float16 and a bf16 task."""
    root = tmp_path_factory.mktemp("mixed")
    dtypes = [torch.float32, torch.float16, None]
    base_dir, task_dirs, _, _ = build_model_set(root, task_dtypes=dtypes, task_shard=70_000)
    return {"base": base_dir, "tasks": task_dirs}


@pytest.mark.usefixtures("ray_s3")
@pytest.mark.parametrize(
    "method, models, extra",
    [
        ("ties", "tiny", {}),
        ("dare_ties", "tiny", {}),
        ("linear", "tiny", {}),
        ("ram_plus", "mixed", {"out_dtype": "float32", "workers": 1, "unit_budget_bytes": 1000}),
    ],
)
def test_every_output_path_gives_the_same_bytes(
    request, tmp_path, method, models, extra, options, fs
):
    """The direct local path (checked against the reference in test_merge_exact and
    test_baselines_engine), S3 parts, and memory://, which takes no parts from workers, so the
    driver streams it (as for gs:// or hf://): the same shards, byte for byte."""
    import fsspec

    tiny = request.getfixturevalue(models)
    parameters = {"ties": {"density": 0.5}, "dare_ties": {"density": 0.5, "seed": 3}}
    kw = {"unit_budget_bytes": 4096, "method": method, "parameters": parameters.get(method, {})}
    kw.update(extra)
    _merge(tiny["base"], tiny["tasks"], tmp_path / "local", **kw)
    through = _merge(tiny["base"], tiny["tasks"], f"memory://through/{method}", **kw)
    m = through["passes"]["map"]
    assert m["output_path"] == "through-driver" and "memory://" in m["output_path_reason"]
    assert m["bytes_written_by_workers"] == 0
    assert m["bytes_written_by_driver"] == m["bytes_written"] > 0
    s3 = _merge(tiny["base"], tiny["tasks"], f"s3://{BUCKET}/{method}", options, **kw)
    assert s3["passes"]["map"]["output_path"] == "direct"
    mem = fsspec.filesystem("memory")
    for p in sorted((tmp_path / "local").glob("*.safetensors")):
        assert mem.cat_file(f"/through/{method}/{p.name}") == p.read_bytes()
        assert fs.cat_file(f"{BUCKET}/{method}/{p.name}") == p.read_bytes()


@pytest.mark.usefixtures("ray_s3")
def test_results_are_taken_as_they_finish():
    def slow_first(item: int) -> int:
        time.sleep(3.0 if item == 0 else 0.0)
        return item * 10

    got = [
        (item, result)
        for item, _, result in unordered_map(slow_first, range(6), (), 2, {"num_cpus": 1})
    ]
    assert sorted(got) == [(i, i * 10) for i in range(6)]
    assert got[-1] == (0, 0)  # one slow item held back nobody


def test_plan_says_which_output_path(tiny, tmp_path, capsys):
    from ram_dist.cli import main

    args = ["plan", "--base", str(tiny["base"]), "--out", str(tmp_path / "p")]
    for t in tiny["tasks"]:
        args += ["--task", str(t)]
    assert main(args) == 0
    assert "output path: direct (a local folder on a one-node cluster" in capsys.readouterr().out
    planned = run_plan(
        MergeConfig(
            base=str(tiny["base"]), tasks=tuple(map(str, tiny["tasks"])), out="memory://x/y"
        )  # fmt: skip
    ).data
    assert planned["output"]["path"] == "through-driver"


def test_paths_are_chosen_by_store_and_cluster(tmp_path, options):
    from ram_dist.io.sinks import choose_sink

    storage = Storage(options)
    local = str(tmp_path / "o")
    assert choose_sink(local, storage, shared=False, single_node=True).path == "direct"
    assert choose_sink(local, storage, shared=False, single_node=False).path == "through-driver"
    assert choose_sink(local, storage, shared=True, single_node=False).path == "direct"
    s3 = choose_sink("s3://b/o", storage, shared=False, single_node=False)
    assert s3.path == "direct" and "multipart" in s3.reason
    gs = choose_sink("memory://b/o", storage, shared=True, single_node=True)
    assert gs.path == "through-driver"
