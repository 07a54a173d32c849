"""Parts survive failures: a driver SIGKILLed mid-shard resumes inside the shard on S3, and
on a three-node cluster a worker killed mid-part is re-run, with parts from several nodes.

moto's S3 server delays each UploadPart (a slow link), so parts are in flight when a test
stops something; the server's log says which parts were uploaded, and when.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import torch
from builders import load_checkpoint
from killing import kill_once_recorded

from ram_dist.api import run_merge
from ram_dist.io.storage import Storage
from ram_dist.io.verify import verify
from ram_dist.planning.config import MergeConfig

BUCKET = "failures"


def _fetch_and_compare(fs, prefix: str, expected: dict, tmp_path) -> None:
    local = tmp_path / "fetched"
    fs.get(f"{BUCKET}/{prefix}", str(local), recursive=True)
    merged = load_checkpoint(local)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def test_driver_killed_mid_shard_resumes_inside_it(big, options, fs, server, tmp_path):
    out = f"s3://{BUCKET}/killed"
    args = [sys.executable, "-m", "ram_dist.cli", "merge", "--base", big["s3"][0],
            "--out", out, "--unit-mb", "1", "--workers", "1",
            "--storage-options", json.dumps(options)]  # fmt: skip
    for t in big["s3"][1]:
        args += ["--task", t]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    server.clear()
    server.part_delay_s = 1.0  # a shard's three parts take longer than a manifest save
    try:
        manifest = kill_once_recorded(
            args, env, lambda: fs.cat_file(f"{BUCKET}/killed/ram_dist_manifest.json")
        )
    finally:
        server.part_delay_s = 0.0
    time.sleep(1.5)  # a part the server was still receiving ends either way
    kept = {
        (f"/{BUCKET}/killed/{name}", int(n))
        for name, w in manifest["writing"].items()
        for n in w["parts"]
    }
    assert kept <= set(server.uploaded_parts())
    for name in manifest["shard_names"]:
        if name not in manifest["shards"]:  # nothing at an unfinished shard's key
            fs.invalidate_cache()
            assert not fs.exists(f"{BUCKET}/killed/{name}")
    assert not fs.exists(f"{BUCKET}/killed/model.safetensors.index.json")

    server.clear()
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = set(server.uploaded_parts())
    assert not kept & again, "a part recorded before the crash was uploaded again"
    report = json.loads(fs.cat_file(f"{BUCKET}/killed/merge_report.json"))
    assert report["passes"]["reduce"]["skipped"] is True
    assert report["passes"]["map"]["parts_reused"] >= len(kept)
    _fetch_and_compare(fs, "killed", big["expected"], tmp_path)
    assert verify(out, Storage(options))[0] == []


def _map_task_workers(gcs_address: str) -> list[psutil.Process]:
    """This cluster's worker processes now running a ram-dist task (Ray titles them
    `ray::_run`; their parent is a raylet of the cluster at `gcs_address`)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if " ".join(p.info["cmdline"] or []).startswith("ray::_run"):
                parent = p.parent()
                port = gcs_address.rsplit(":", 1)[1]
                args = parent.cmdline() if parent is not None else []
                if any(a.startswith("--gcs-address=") and a.endswith(f":{port}") for a in args):
                    found.append(p)
        except psutil.Error:
            continue
    return found


def test_three_nodes_upload_parts_and_survive_a_killed_worker(
    big, options, fs, server, own_ray, tmp_path
):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    out = f"s3://{BUCKET}/cluster"
    config = MergeConfig(
        base=big["s3"][0], tasks=tuple(big["s3"][1]), out=out, unit_budget_bytes=2**20,
        storage_options=options, input_cache="off",
    )  # fmt: skip
    errors: list[BaseException] = []
    reports: list[dict] = []
    killed: list[int] = []

    def run() -> None:
        try:
            reports.append(run_merge(config).data)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    server.clear()
    server.part_delay_s = 0.4
    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 240
        while not killed:
            assert thread.is_alive(), f"merge ended before a ray::_run worker was killed: {errors}"
            assert time.monotonic() < deadline, errors
            if server.uploaded_parts():  # the map pass is uploading; parts are in flight
                for p in _map_task_workers(cluster.address)[:1]:
                    killed.append(p.pid)
                    p.send_signal(signal.SIGKILL)
            time.sleep(0.05)
        thread.join(timeout=300)
        assert not thread.is_alive() and not errors, errors
        server.part_delay_s = 0.0
        # A local folder on these three nodes: through the driver, unless declared shared
        # (it is: the nodes share this machine's disk), when the workers write it in place.
        # Inputs from a slow store: a unit that finishes in a few milliseconds leaves its
        # worker free for the next, and Ray would run every unit on the driver's node.
        server.get_delay_s = 0.05
        local = {}
        for shared in (False, True):
            out_dir = tmp_path / f"local-{shared}"
            local[shared] = run_merge(
                MergeConfig(base=big["s3"][0], tasks=tuple(big["s3"][1]), out=str(out_dir),
                            unit_budget_bytes=2**20, output_shared=shared,
                            storage_options=options, input_cache="off")
            ).data["passes"]["map"]  # fmt: skip
            merged = load_checkpoint(out_dir)
            assert all(torch.equal(merged[k], v) for k, v in big["expected"].items())
    finally:
        server.part_delay_s = server.get_delay_s = 0.0
        ray.shutdown()
        cluster.shutdown()
    assert local[False]["output_path"] == "through-driver"
    assert "several nodes without --output-shared" in local[False]["output_path_reason"]
    assert local[False]["bytes_written_by_driver"] == local[False]["bytes_written"]
    assert local[True]["output_path"] == "direct" and local[True]["bytes_written_by_driver"] == 0
    assert len(local[True]["units_per_node"]) >= 2
    report = reports[0]
    m = report["passes"]["map"]
    assert m["output_path"] == "direct" and m["bytes_written_by_driver"] == 0
    assert len(m["units_per_node"]) >= 2, m["units_per_node"]  # parts from several nodes
    uploads = server.uploaded_parts(".safetensors")
    assert len(uploads) - len(set(uploads)) <= 1  # only the killed task's part, if any, twice
    _fetch_and_compare(fs, "cluster", big["expected"], tmp_path)
    assert verify(out, Storage(options))[0] == []
