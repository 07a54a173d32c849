"""Survive failures: a node lost mid-pass, a driver killed mid-pass, changed inputs refused;
`ram-dist verify` of a resumed output on S3 (its own tests: tests/io/test_verify.py).

A killed run is a `ram-dist` process with its own embedded Ray, killed with its workers (its
process group); the runs that resume it join the shared Ray (`shared_ray`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import shared_ray
import torch
from builders import build_model_set, load_checkpoint, save_checkpoint
from killing import env_without_ray, kill_after_first_shard, manifest_or_none
from reference import reference_merge
from s3_server import CountingMotoServer

from ram_dist.cli import main

ONE_ROW_MB = str(256 / 2**20)  # one 128-wide bf16 row per unit: a slow, many-unit map pass


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"base": base_dir, "tasks": task_dirs, "expected": expected, "root": root}


def _args(models: dict, out: str, *extra: str) -> list[str]:
    args = ["merge", "--base", str(models["base"]), "--out", out, *extra]
    for t in models["tasks"]:
        args += ["--task", str(t)]
    return args


@pytest.fixture(scope="module")
def crashed(models) -> tuple[Path, dict, dict[str, int]]:
    """An output whose driver was SIGKILLed in the map pass: (folder, manifest, shard mtimes)."""
    out = models["root"] / "crashed"
    manifest = kill_after_first_shard(
        _args(models, str(out), "--unit-mb", ONE_ROW_MB, "--workers", "1"),
        env_without_ray(),
        lambda: manifest_or_none((out / "ram_dist_manifest.json").read_text),
        mid_shard=True,
        out=out,
    )
    assert not (out / "model.safetensors.index.json").exists()
    mtimes = {name: (out / name).stat().st_mtime_ns for name in manifest["shards"]}
    return out, manifest, mtimes


@pytest.fixture
def one_ray() -> None:
    """The shared Ray (`shared_ray`), which a test's commands join rather than each starting
    (and stopping) an embedded one. Asked for by each test, not by the module:
    test_node_removed_during_map_pass shuts it down for a cluster of its own."""
    shared_ray.start()


def _copy(crashed, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(crashed[0], out, copy_function=shutil.copy2)
    return out


@pytest.mark.usefixtures("one_ray")
def test_rerun_after_sigkill_resumes_with_identical_bytes(models, crashed, tmp_path):
    out, manifest, mtimes = crashed
    done = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", *_args(models, str(out))],
        env=shared_ray.joining_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "merge_report.json").read_text())
    assert report["passes"]["reduce"]["skipped"] is True
    # The shards finished before the kill, in whatever order they were finished.
    assert sorted(report["output"]["shards_reused"]) == sorted(manifest["shards"])
    assert set(report["output"]["shards_written"]) == set(manifest["shard_names"]) - set(mtimes)
    for name, mtime in mtimes.items():  # finished shards were not rewritten
        assert (out / name).stat().st_mtime_ns == mtime
    # Inside the shards being written, the recorded parts were not made or written again. The
    # kill waited for finished parts in one of them; the next may have its plan and no part yet.
    recorded = [(w["parts"], w["plan"]) for w in manifest["writing"].values()]
    assert any(parts for parts, _ in recorded)
    m = report["passes"]["map"]
    assert m["parts_reused"] >= sum(len(parts) for parts, _ in recorded)
    unfinished = sum(plan[-1][1] for _, plan in recorded) + sum(
        (out / n).stat().st_size
        for n in report["output"]["shards_written"]
        if n not in manifest["writing"]
    )
    reused = sum(p["stop"] - p["start"] for parts, _ in recorded for p in parts.values())
    assert m["bytes_written_by_workers"] <= unfinished - reused
    merged = load_checkpoint(out)
    assert all(torch.equal(merged[k], v) for k, v in models["expected"].items())
    assert "reduce skipped" in done.stdout and "reused" in done.stdout
    # The killed run's lease was taken over at once: its process is gone from this host.
    assert "took over the lease of job ram-dist merge" in done.stdout
    assert "that process no longer exists" in done.stdout
    assert not (out / ".ram-dist-lease.json").exists()
    # A third run finds the merge complete and does nothing.
    again = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", *_args(models, str(out))],
        env=shared_ray.joining_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and "nothing to do" in again.stdout


@pytest.mark.usefixtures("one_ray")
def test_changed_parameter_or_input_is_refused(models, crashed, tmp_path, capsys):
    out = _copy(crashed, tmp_path)
    assert main(_args(models, str(out), "--r", "0.2")) == 2
    assert "parameter r: 0.1 -> 0.2" in capsys.readouterr().err
    task = tmp_path / "task1-changed"
    shutil.copytree(models["tasks"][1], task)
    state = load_checkpoint(task)
    state["model.norm.weight"] = state["model.norm.weight"] * 2
    save_checkpoint(state, task, max_shard_bytes=70_000)
    args = _args(models, str(out))
    args[args.index(str(models["tasks"][1]))] = str(task)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"task 2: location {models['tasks'][1]} -> {task}" in err and "--overwrite" in err
    # The same folder with new content: named by file and by what changed.
    moved = tmp_path / "same-place"
    shutil.copytree(models["tasks"][1], moved)
    other = _args(models, str(tmp_path / "fresh"))
    other[other.index(str(models["tasks"][1]))] = str(moved)
    assert main(other + ["--unit-mb", "1"]) == 0
    capsys.readouterr()
    time.sleep(0.01)
    save_checkpoint(state, moved, max_shard_bytes=70_000)
    assert main(other) == 2
    err = capsys.readouterr().err
    assert f"task 2 ({moved}): file model-" in err and "changed (" in err


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[CountingMotoServer, dict]]:
    import s3fs

    server = CountingMotoServer()
    server.start()
    env = env_without_ray(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    options = {"s3": {"endpoint_url": server.endpoint, "use_listings_cache": False}}
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    s3fs.S3FileSystem(**options["s3"]).mkdir("resume")
    yield server, {"env": env, "options": options}
    server.stop()


@pytest.mark.usefixtures("one_ray")
def test_resume_on_s3_output(models, s3):
    import s3fs

    server, conf = s3
    fs = s3fs.S3FileSystem(**conf["options"]["s3"])
    extra = ("--storage-options", json.dumps(conf["options"]))
    url = "s3://resume/out"

    def read_manifest():
        try:
            return json.loads(fs.cat_file("resume/out/ram_dist_manifest.json"))
        except (FileNotFoundError, ValueError):
            return None

    args = _args(models, url, "--unit-mb", ONE_ROW_MB, "--workers", "1", *extra)
    manifest = kill_after_first_shard(args, conf["env"], read_manifest)
    finished = sorted(manifest["shards"])
    etags = {n: fs.info(f"resume/out/{n}", refresh=True)["ETag"] for n in finished}
    server.clear()
    done = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", *_args(models, url, *extra)],
        env=shared_ray.joining_env(**conf["env"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    writes = {s.path.rsplit("/", 1)[-1] for s in server.log if s.method in ("PUT", "POST")}
    assert not writes & set(finished)  # finished shards were not uploaded again
    assert {n: fs.info(f"resume/out/{n}", refresh=True)["ETag"] for n in finished} == etags
    report = json.loads(fs.cat_file("resume/out/merge_report.json"))
    assert report["passes"]["reduce"]["skipped"] is True
    assert sorted(report["output"]["shards_reused"]) == sorted(finished)
    local = Path(models["root"]) / "fetched"
    fs.get("resume/out", str(local), recursive=True)
    merged = load_checkpoint(local)
    assert all(torch.equal(merged[k], v) for k, v in models["expected"].items())
    verify = subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", "verify", url, *extra],
        env=conf["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0, verify.stderr


@pytest.mark.usefixtures("one_ray")
def test_a_method_with_driver_factors_resumes_with_its_recorded_state(models, tmp_path):
    """model_stock's factors (from exact sums, on the driver) come back from the manifest's
    JSON: a run killed in the map pass resumes without its reduce pass and writes the bytes
    of an uninterrupted run."""
    whole = tmp_path / "whole"
    assert main(_args(models, str(whole), "--method", "model_stock")) == 0
    out = tmp_path / "out"
    kill_after_first_shard(
        _args(models, str(out), "--method", "model_stock", "--unit-mb", ONE_ROW_MB,
              "--workers", "1"),
        env_without_ray(),
        lambda: manifest_or_none((out / "ram_dist_manifest.json").read_text),
        out=out,
    )  # fmt: skip
    assert main(_args(models, str(out), "--method", "model_stock")) == 0
    report = json.loads((out / "merge_report.json").read_text())
    assert report["passes"]["reduce"]["skipped"] is True
    assert report["output"]["shards_reused"]
    resumed, expected = load_checkpoint(out), load_checkpoint(whole)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(resumed[name].view(torch.uint8), value.view(torch.uint8)), name


def test_node_removed_during_map_pass(models, own_ray, tmp_path):
    """Head plus two worker nodes; one worker node is removed while the map pass runs."""
    import ray
    from ray.cluster_utils import Cluster

    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    out = tmp_path / "out"
    errors: list[BaseException] = []
    config = MergeConfig(
        base=str(models["base"]),
        tasks=tuple(map(str, models["tasks"])),
        out=str(out),
        unit_budget_bytes=256,
        workers=2,
    )

    reports: list[dict] = []

    def run() -> None:
        try:
            reports.append(run_merge(config).data)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    raylet = psutil.Process(workers[1].all_processes["raylet"][0].process.pid)
    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 120
        # Remove the node the moment it runs a map task (Ray titles the worker ray::_run):
        # that task is lost with it, and Ray must run it again elsewhere.
        while True:
            assert time.monotonic() < deadline and thread.is_alive(), errors
            if (out / "ram_dist_manifest.json").exists() and _running_a_task(raylet):
                cluster.remove_node(workers[1])
                break
            time.sleep(0.002)
        thread.join(timeout=300)
        assert not thread.is_alive() and not errors, errors
    finally:
        ray.shutdown()
        cluster.shutdown()
    merged = load_checkpoint(out)
    assert all(torch.equal(merged[k], v) for k, v in models["expected"].items())
    # A unit was lost with the node and run again: the retried attempt reports itself.
    assert reports[0]["passes"]["map"]["tasks_retried"] >= 1, reports[0]["passes"]["map"]


def _running_a_task(raylet: psutil.Process) -> bool:
    """Whether a worker of this raylet is running one of ram-dist's tasks now."""
    for child in raylet.children():
        try:
            if " ".join(child.cmdline()).startswith("ray::_run"):
                return True
        except psutil.Error:
            continue
    return False
