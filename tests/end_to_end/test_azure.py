"""Azure Blob in and out, for real: adlfs over HTTP to Azurite (behind the test proxy of
`azurite_server`, which counts what it serves and injects faults), real Ray workers.

Workers stage the blocks of each shard's blob and the driver commits each shard with one
Put Block List; a run killed mid-shard is resumed with the blocks already staged; a lease
gives one writer per output; throttling is ridden out by the SDK's retries; a failure is one
line and publishes nothing.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import pytest
import torch
from azurite_server import AzuriteServer, container_fs, running_azurite, storage_options
from big_model import build_big_set
from builders import INDEX_NAME, build_model_set, load_checkpoint, merge_config
from killing import kill_once_recorded
from reference import reference_merge
from s3_server import LOCATION_DEPENDENT, header_read_bytes

from ram_dist.api import run_merge
from ram_dist.errors import StorageError
from ram_dist.io.lease import LEASE_NAME, OutputLease
from ram_dist.io.lease.store import LeaseHeld
from ram_dist.io.storage import Storage
from ram_dist.io.verify import verify

CONTAINER = "ram-dist-azure"
MANIFEST = "ram_dist_manifest.json"


@pytest.fixture(scope="module")
def server() -> Iterator[AzuriteServer]:
    with running_azurite() as srv:
        yield srv


@pytest.fixture(scope="module")
def options(server) -> dict:
    return storage_options()


@pytest.fixture(scope="module")
def fs(server) -> Any:
    return container_fs(CONTAINER)


@pytest.fixture(scope="module")
def ray_azure(server, own_ray) -> Iterator[None]:
    """A real local Ray started after the server (its workers inherit the connection
    string)."""
    from conftest import local_ray

    with local_ray():
        yield


def _put(fs: Any, folder, prefix: str) -> None:
    for f in sorted(folder.iterdir()):
        fs.put_file(str(f), f"{CONTAINER}/{prefix}/{folder.name}/{f.name}")


@pytest.fixture(scope="module")
def models(tmp_path_factory, fs) -> dict:
    """Small local inputs, the same uploaded to the container, and the reference merge."""
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    for d in [base_dir, *task_dirs]:
        _put(fs, d, "in")
    files = [p for d in [base_dir, *task_dirs] for p in d.glob("*.safetensors")]
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {
        "local": (base_dir, task_dirs),
        "az": (f"az://{CONTAINER}/in/base", [f"az://{CONTAINER}/in/{d.name}" for d in task_dirs]),
        "expected": expected,
        "header_bytes": sum(header_read_bytes(p) for p in files),
    }


@pytest.fixture(scope="module")
def big(tmp_path_factory, fs) -> dict:
    """Shards of 12 MiB: three blocks of at least 5 MiB each."""
    models = build_big_set(tmp_path_factory.mktemp("big"))
    for d in [models["base"], *models["tasks"]]:
        _put(fs, d, "big")
    models["az"] = (
        f"az://{CONTAINER}/big/base",
        [f"az://{CONTAINER}/big/{d.name}" for d in models["tasks"]],
    )
    return models


def _merge(base, tasks, out, options=None, **kw) -> dict:
    kw.setdefault("unit_budget_bytes", 8192)
    return run_merge(merge_config(base, tasks, out, options, **kw)).data


def _fetched(fs: Any, prefix: str, tmp_path) -> dict:
    local = tmp_path / prefix.replace("/", "-")
    local.mkdir()
    for p in fs.find(f"{CONTAINER}/{prefix}"):
        fs.get_file(p, str(local / p.rsplit("/", 1)[-1]))
    return load_checkpoint(local)


def _equal(merged: dict, expected: dict) -> None:
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def _names(fs: Any, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{CONTAINER}/{prefix}"))


@pytest.mark.usefixtures("ray_azure")
def test_container_to_container_equals_reference_and_local_merge(
    models, options, fs, server, tmp_path
):
    _merge(*models["local"], tmp_path / "local")
    server.clear()
    # Inputs as az://container/path, the output as abfs://container@account.dfs...
    out = f"abfs://{CONTAINER}@devstoreaccount1.dfs.core.windows.net/out"
    report = _merge(*models["az"], out, options)

    local = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert _names(fs, "out") == local
    for name in local:
        if name not in LOCATION_DEPENDENT:
            assert (
                fs.cat_file(f"{CONTAINER}/out/{name}") == (tmp_path / "local" / name).read_bytes()
            )
    _equal(_fetched(fs, "out", tmp_path), models["expected"])

    m = report["passes"]["map"]
    assert m["output_path"] == "direct" and "Azure Blob" in m["output_path_reason"]
    assert m["bytes_written_by_driver"] == 0
    assert m["bytes_written_by_workers"] == m["bytes_written"] > 0
    # Each shard's bytes went up as staged blocks from the workers, one commit per shard.
    blocks = server.put_blocks(".safetensors")
    assert sum(s.nbytes for s in blocks) == 0  # Put Block answers carry no body
    commits = [s for s in server.served() if "comp=blocklist" in s.query
               and s.method == "PUT" and s.path.endswith(".safetensors")]  # fmt: skip
    assert len(commits) == len(json.loads(fs.cat_file(f"{CONTAINER}/out/{MANIFEST}"))["shards"])
    # Inputs: range requests only, what the passes fetched plus each header once.
    gets = [s for s in server.blob_gets(f"{CONTAINER}/in/") if s.path.endswith(".safetensors")]
    assert gets and all(s.range is not None for s in gets)
    fetched = report["passes"]["reduce"]["bytes_fetched"] + m["bytes_fetched"]
    assert sum(s.nbytes for s in gets) == fetched + models["header_bytes"]
    assert verify(out, Storage(options)) == ([], len(commits))


def _cli_args(base: str, tasks: list[str], out: str, options: dict, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "ram_dist.cli", "merge", "--base", base, "--out", out,
            "--storage-options", json.dumps(options), *extra]  # fmt: skip
    for t in tasks:
        args += ["--task", t]
    return args


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


@pytest.mark.usefixtures("ray_azure")
def test_killed_mid_shard_resumes_with_the_staged_blocks(big, options, fs, server, tmp_path):
    """The whole job (`ram-dist merge`, its driver and workers) SIGKILLed once the manifest
    records a staged block of a shard still being written; the re-run (the same job, here on
    the module's Ray) keeps those blocks and stages none of them again; the shards have
    several blocks each, and `verify` passes."""
    out = f"az://{CONTAINER}/killed"
    args = _cli_args(*big["az"], out, options, "--unit-mb", "1", "--workers", "1")

    server.clear()
    server.block_delay_s = 1.0  # a shard's three blocks take longer than a manifest save
    try:
        manifest = kill_once_recorded(
            args, _env(), lambda: fs.cat_file(f"{CONTAINER}/killed/{MANIFEST}")
        )
    finally:
        server.block_delay_s = 0.0
    time.sleep(1.5)  # a block the proxy was still passing on ends either way
    unfinished = [n for n in manifest["shard_names"] if n not in manifest["shards"]]
    assert unfinished and not set(unfinished) & set(_names(fs, "killed"))  # nothing visible
    assert INDEX_NAME not in _names(fs, "killed")
    kept = {(name, _block_id(w["token"], int(n)))
            for name, w in manifest["writing"].items() for n in w["parts"]}  # fmt: skip
    assert kept <= set(_staged(server))

    server.clear()
    report = _merge(*big["az"], out, options, unit_budget_bytes=2**20, workers=1)
    assert not kept & set(_staged(server)), "a block recorded before the kill was staged again"
    m = report["passes"]["map"]
    assert report["passes"]["reduce"]["skipped"] is True
    assert m["parts_reused"] >= len(kept) > 0
    assert m["bytes_written_by_driver"] == 0 and m["bytes_written_by_workers"] > 0
    _equal(_fetched(fs, "killed", tmp_path), big["expected"])
    finished = json.loads(fs.cat_file(f"{CONTAINER}/killed/{MANIFEST}"))["shards"]
    assert max(len(s["parts"]) for s in finished.values()) >= 3  # several blocks a shard
    assert verify(out, Storage(options)) == ([], len(finished))


def _block_id(token: str, number: int) -> str:
    return f"{token}-{number:06d}"


def _staged(server: AzuriteServer) -> list[tuple[str, str]]:
    """(shard name, block id) of each Put Block answered 201."""
    out = []
    for s in server.put_blocks(".safetensors"):
        query = dict(q.split("=", 1) for q in s.query.split("&") if "=" in q)
        block = base64.b64decode(unquote(query["blockid"])).decode()
        out.append((s.path.rsplit("/", 1)[-1], block))
    return out


@pytest.fixture(scope="module")
def leased_then_throttled(ray_azure, models, options, fs, server, tmp_path_factory) -> dict:
    """One output for two tests: a merge into it while another writer holds its lease (refused),
    then, the lease released, the same merge with throttling answers injected: Azure Storage's
    (503 ServerBusy, 500 OperationTimedOut; it sends no 429) to every third block upload or
    range read of a safetensors file, two in all (the SDK waits about 15 s before its first
    retry of each)."""
    out = f"az://{CONTAINER}/leased"
    holder = OutputLease(out, Storage(options), "first-writer")
    holder.acquire()
    refused: LeaseHeld | None = None
    try:
        _merge(*models["az"], out, options)
    except LeaseHeld as e:
        refused = e
    finally:
        holder.release()

    faults: list[tuple[int, str]] = []
    seen = [0]

    def throttle(method: str, path: str, query: str) -> tuple[int, str] | None:
        worker = (method == "PUT" and "comp=block" in query and "blocklist" not in query) or (
            method == "GET" and path.endswith(".safetensors") and "comp=" not in query
        )
        if not worker or len(faults) >= 2:
            return None
        seen[0] += 1
        if seen[0] % 3:
            return None
        faults.append((503, "ServerBusy") if len(faults) % 2 else (500, "OperationTimedOut"))
        return faults[-1]

    server.intercept = throttle
    try:
        report = _merge(*models["az"], out, options)  # free again: the merge runs
    finally:
        server.intercept = None
    merged = _fetched(fs, "leased", tmp_path_factory.mktemp("leased"))
    return {"refused": refused, "faults": faults, "report": report, "merged": merged}


def test_a_second_writer_is_refused_by_the_lease(leased_then_throttled):
    refused = leased_then_throttled["refused"]
    assert isinstance(refused, LeaseHeld) and "first-writer" in str(refused), refused
    # Released, the same output is free again: the merge ran.
    report = leased_then_throttled["report"]
    assert report["passes"]["map"]["bytes_written_by_driver"] == 0


def test_throttling_is_ridden_out_by_the_sdk_retries(leased_then_throttled, models):
    """The throttled merge (`leased_then_throttled`) succeeds, same bytes."""
    assert len(leased_then_throttled["faults"]) == 2
    assert leased_then_throttled["report"]["passes"]["map"]["bytes_written_by_driver"] == 0
    _equal(leased_then_throttled["merged"], models["expected"])


def _one_line(stderr: str, *fragments: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ram-dist: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.mark.usefixtures("ray_azure")
def test_an_input_deleted_while_the_job_runs(models, options, fs, server, tmp_path):
    """Deleted when the job creates its lease (every header read): one line naming the
    file, exit status 2, no index, no shard, no lease left. The job (`ram-dist merge
    --address`) runs on the module's Ray."""
    import ray

    for d in [models["local"][0], *models["local"][1]]:
        _put(fs, d, "deleted")
    victim = f"{CONTAINER}/deleted/task0/model-00001-of-00004.safetensors"
    assert fs.exists(victim)
    deleted: list[bool] = []

    def hook(method: str, path: str, query: str) -> None:
        if method == "PUT" and path.endswith(LEASE_NAME) and not deleted:
            deleted.append(True)
            fs.rm(victim)

    base = f"az://{CONTAINER}/deleted/base"
    tasks = [f"az://{CONTAINER}/deleted/{d.name}" for d in models["local"][1]]
    server.intercept = hook
    try:
        done = subprocess.run(
            _cli_args(base, tasks, f"az://{CONTAINER}/deleted-out", options,
                      "--address", ray.get_runtime_context().gcs_address),
            env=_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        server.intercept = None
    assert deleted and done.returncode == 2, done.stderr
    _one_line(done.stderr, f"input az://{victim}: cannot read: no such file")
    names = _names(fs, "deleted-out")
    assert INDEX_NAME not in names and LEASE_NAME not in names, names
    assert not [n for n in names if n.endswith(".safetensors")], names


@pytest.mark.usefixtures("ray_azure")
def test_missing_container_and_refused_credentials(models, options, server):
    with pytest.raises(StorageError) as e:
        _merge("az://no-such-container/in/base", models["az"][1], f"az://{CONTAINER}/x", options)
    assert "\n" not in str(e.value) and e.value.exit_status == 2
    assert "az://no-such-container/in/base" in str(e.value)
    assert "container no-such-container does not exist" in str(e.value), str(e.value)

    with pytest.raises(StorageError) as e:
        _merge(*models["az"], "az://no-such-container/out", options)
    assert "\n" not in str(e.value) and e.value.exit_status == 2
    assert "container no-such-container does not exist" in str(e.value), str(e.value)

    wrong = server.connection_string.replace("AccountKey=Eby8", "AccountKey=AAAA")
    bad = {"az": {"connection_string": wrong, "skip_instance_cache": True}}
    with pytest.raises(StorageError) as e:
        _merge(*models["az"], f"az://{CONTAINER}/refused", bad)
    assert "\n" not in str(e.value) and e.value.exit_status == 2
    assert "refused the credentials (AuthenticationFailed" in str(e.value), str(e.value)
