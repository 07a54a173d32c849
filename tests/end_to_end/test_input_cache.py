"""The pass-1 input cache: bucket-to-bucket merges fetch each input byte once, for real.

moto's S3 server over HTTP counts what it serves; the merges run on a real multi-node Ray
(`ray.cluster_utils.Cluster`: a head without CPUs and two one-CPU worker nodes, each with its
own temp dir, so each has its own node-local cache as separate machines would).
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from builders import build_model_set, load_checkpoint, merge_config, save_checkpoint
from disk_room import cache_room
from reference import reference_merge
from s3_server import (
    LOCATION_DEPENDENT,
    CountingMotoServer,
    env,
    header_read_bytes,
)

from ram_dist.api import run_merge
from ram_dist.cli import main
from ram_dist.engine import driver
from ram_dist.engine.pass_context import PassContext
from ram_dist.engine.passes import reduce_pass
from ram_dist.engine.runtime import ray_session
from ram_dist.io.range_cache import InputCache, Traffic
from ram_dist.io.storage import Storage
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.input_cache import choose_input_cache
from ram_dist.planning.job import prepare

BUCKET = "ram-dist-cache-test"
#: The tests that count what the cache kept: skipped on a disk within its reserve.
CACHE_ROOM = cache_room()


# -- the cache alone, no Ray ---------------------------------------------------------------


def _ranges(path: Path) -> list[tuple[str, int, int]]:
    return [(str(path), 0, 100), (str(path), 100, 356), (str(path), 356, 356)]


def _read(storage: Storage, ranges: list[tuple[str, int, int]]) -> tuple[list[bytes], object]:
    traffic = Traffic()
    blobs = storage.read_ranges(ranges, traffic=traffic)
    return [bytes(b) for b in blobs], traffic.total()


@CACHE_ROOM
def test_cache_keeps_reads_back_and_evicts(tmp_path):
    data = os.urandom(356)
    (tmp_path / "input.bin").write_bytes(data)
    want = [data[:100], data[100:356], b""]
    ranges = _ranges(tmp_path / "input.bin")
    cache = InputCache("job", local_inputs=True, base_dir=str(tmp_path / "cache"))
    first = Storage(cache=cache)
    assert _read(first, ranges) == (want, _traffic(0, 356))  # fetched, kept
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert sorted(p.stat().st_size for p in files) == [100, 256]
    (tmp_path / "input.bin").write_bytes(bytes(356))  # from here on, only the cache has `data`
    assert _read(first, ranges) == (want, _traffic(356, 0))
    last = Storage(cache=cache.for_last_pass())
    assert _read(last, ranges) == (want, _traffic(356, 0))  # the last reader deletes its hits
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert _read(last, ranges) == ([bytes(100), bytes(256), b""], _traffic(0, 0))
    assert cache.remove() == 1 and not list((tmp_path / "cache").iterdir())


def _traffic(read: int, written: int) -> object:
    from ram_dist.io.range_cache import CacheTraffic

    return CacheTraffic(read, written)


def test_full_disk_wrong_file_or_unsafe_folder_means_fetching(tmp_path):
    data = os.urandom(356)
    (tmp_path / "input.bin").write_bytes(data)
    ranges = _ranges(tmp_path / "input.bin")
    want = [data[:100], data[100:356], b""]
    full = InputCache("job", local_inputs=True, base_dir=str(tmp_path), reserve_min_bytes=1 << 62)
    assert _read(Storage(cache=full), ranges) == (want, _traffic(0, 0))  # no room: not kept
    cache = InputCache("job", local_inputs=True, base_dir=str(tmp_path / "c"))
    _read(Storage(cache=cache), ranges)
    for kept in (p for p in (tmp_path / "c").rglob("*") if p.is_file()):
        kept.write_bytes(b"short")  # not what was kept: a miss, never these bytes
    assert _read(Storage(cache=cache), ranges)[0] == want
    os.chmod(cache.root(), 0o777)  # others could plant files: not used at all
    assert _read(Storage(cache=cache), ranges) == (want, _traffic(0, 0))
    remote_only = InputCache("job", base_dir=str(tmp_path / "r"))  # `auto`: local files not kept
    assert _read(Storage(cache=remote_only), ranges) == (want, _traffic(0, 0))


# -- bucket to bucket on a multi-node Ray ----------------------------------------------------


@pytest.fixture(scope="module")
def nodes(server, own_ray, tmp_path_factory) -> Iterator[dict]:
    """Head (no CPUs: it runs no unit) and two worker nodes, each with its own temp dir."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    workers, tmpdirs = [], []
    for i in range(2):
        tmpdirs.append(tmp_path_factory.mktemp(f"node{i}-tmp"))
        with env(TMPDIR=str(tmpdirs[-1])):  # the node's processes inherit it
            workers.append(cluster.add_node(num_cpus=1))
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield {"cluster": cluster, "workers": workers, "tmpdirs": tmpdirs}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _job_folders(nodes: dict) -> list[Path]:
    return [p for d in nodes["tmpdirs"] for p in d.glob(f"ram-dist-cache-{os.getuid()}/*")]


@pytest.fixture(scope="module")
def models(tmp_path_factory, fs) -> dict:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    for d in [base_dir, *task_dirs]:
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    files = [p for d in [base_dir, *task_dirs] for p in d.glob("*.safetensors")]
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in files)
    return {
        "root": root,
        "local": (base_dir, task_dirs),
        "s3": (f"s3://{BUCKET}/in/base", [f"s3://{BUCKET}/in/{d.name}" for d in task_dirs]),
        "states": (base, tasks),
        "input_bytes": sum(p.stat().st_size for p in files),
        "header_bytes": headers,
        "header_reads": sum(header_read_bytes(p) for p in files),
    }


def _config(base, tasks, out, options=None, **kw) -> MergeConfig:
    kw.setdefault("unit_budget_bytes", 8192)
    return merge_config(base, tasks, out, options, **kw)


def _fetched(server: CountingMotoServer, prefix: str = "in/") -> int:
    gets = server.object_gets(f"{BUCKET}/{prefix}")
    return sum(s.nbytes for s in gets if s.path.endswith(".safetensors"))


def _same_as_local(fs, prefix: str, local: Path) -> None:
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}", refresh=True))
    assert names == sorted(p.name for p in local.iterdir())
    for name in names:
        if name not in LOCATION_DEPENDENT:
            assert fs.cat_file(f"{BUCKET}/{prefix}/{name}") == (local / name).read_bytes(), name


@CACHE_ROOM
@pytest.mark.usefixtures("nodes")
def test_bucket_merge_fetches_each_input_byte_once(models, options, fs, server, nodes, tmp_path):
    base, tasks = models["s3"]
    tensor_bytes = models["input_bytes"] - models["header_bytes"]  # every tensor is floating
    run_merge(_config(*models["local"], tmp_path / "local"))
    server.clear()
    report = run_merge(_config(base, tasks, f"s3://{BUCKET}/once", options)).data
    reduce, merged = report["passes"]["reduce"], report["passes"]["map"]
    assert report["input_cache"]["used"] and report["input_cache"]["nodes_cleaned"] == 3
    assert reduce["bytes_read"] == reduce["cache_bytes_written"] == tensor_bytes
    assert merged["bytes_read"] == merged["cache_bytes_read"] == tensor_bytes
    assert merged["bytes_fetched"] == 0 and merged["cache_bytes_written"] == 0
    # Each tensor byte once, plus the driver's header reads (the length, the header and what
    # follows up to 256 KiB: the whole of these tiny files; a real shard's data is not read)
    assert _fetched(server) == tensor_bytes + models["header_reads"]
    # Every map unit went back to the node that read (and kept) its bytes, and both nodes
    # worked: the hits above are not one node's shared disk.
    assert merged["units_sent_back"] == merged["units_ran_there"] == merged["units"]
    assert len(reduce["units_per_node"]) == 2
    assert _job_folders(nodes) == []  # removed on every node after the merge
    _same_as_local(fs, "once", tmp_path / "local")

    server.clear()
    argv = ["merge", "--base", base, "--out", f"s3://{BUCKET}/twice", "--unit-mb", "0.0078125"]
    argv += ["--input-cache", "off", "--storage-options", json.dumps(options)]
    assert main(argv + sum([["--task", t] for t in tasks], [])) == 0
    report = json.loads(fs.cat_file(f"{BUCKET}/twice/merge_report.json"))
    assert not report["input_cache"]["used"]
    assert report["passes"]["reduce"]["cache_bytes_written"] == 0
    assert _fetched(server) == 2 * tensor_bytes + models["header_reads"]
    _same_as_local(fs, "twice", tmp_path / "local")


@CACHE_ROOM
@pytest.mark.usefixtures("nodes")
def test_ties_rounds_read_the_cache(models, options, fs, server, tmp_path):
    base, tasks = models["s3"]
    tensor_bytes = models["input_bytes"] - models["header_bytes"]
    ties = {"method": "ties", "parameters": {"density": 0.5, "weight": 1.0}}
    run_merge(_config(*models["local"], tmp_path / "local", **ties))
    server.clear()
    report = run_merge(_config(base, tasks, f"s3://{BUCKET}/ties", options, **ties)).data
    reduce = report["passes"]["reduce"]
    assert reduce["bytes_read"] >= 2 * tensor_bytes  # several rounds
    assert reduce["bytes_fetched"] == reduce["cache_bytes_written"] == tensor_bytes
    assert _fetched(server) == tensor_bytes + models["header_reads"]
    _same_as_local(fs, "ties", tmp_path / "local")


@CACHE_ROOM
@pytest.mark.usefixtures("nodes")
def test_changed_input_never_hits_a_killed_jobs_cache(models, options, fs, server, nodes):
    """A killed job's cache (its reduce pass only) is ignored once an input changed (new
    ETag, same names and byte ranges), and reused by a re-run with the same inputs."""
    for d in ["base", "task0", "task1", "task2"]:
        fs.copy(f"{BUCKET}/in/{d}", f"{BUCKET}/stale/{d}", recursive=True)
    base = f"s3://{BUCKET}/stale/base"
    tasks = [f"s3://{BUCKET}/stale/task{i}" for i in range(3)]
    config = _config(base, tasks, f"s3://{BUCKET}/stale-out", options)
    killed = prepare(config)
    cache, _ = choose_input_cache(killed)
    assert cache is not None
    with ray_session(None, lambda: None) as (cluster, _):
        reduce_pass(PassContext(killed, cluster, cache=cache))  # then "killed": its cache stays
    left = _job_folders(nodes)
    assert left

    state = load_checkpoint(models["local"][1][1])
    changed = {k: (v * 2 if k == "model.norm.weight" else v) for k, v in state.items()}
    save_checkpoint(changed, models["root"] / "changed", max_shard_bytes=70_000)
    for f in (models["root"] / "changed").glob("*.safetensors"):
        fs.put(str(f), f"{BUCKET}/stale/task1/{f.name}")
    report = run_merge(config).data
    assert report["passes"]["reduce"]["cache_bytes_read"] == 0
    assert report["passes"]["map"]["cache_bytes_read"] == report["passes"]["reduce"]["bytes_read"]
    fetched = Path(models["root"]) / "stale-fetched"
    fs.get(f"{BUCKET}/stale-out", str(fetched), recursive=True)
    base_state, task_states = models["states"]
    expected, _ = reference_merge(base_state, [task_states[0], changed, task_states[2]], "ram_plus")
    merged = load_checkpoint(fetched)
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    assert _job_folders(nodes) == left  # the killed job's, untouched

    for f in Path(models["local"][1][1]).glob("*.safetensors"):  # the same bytes again
        fs.put(str(f), f"{BUCKET}/stale/task1/{f.name}")
    server.clear()
    stale_out = _config(base, tasks, f"s3://{BUCKET}/stale-out", options, overwrite=True)
    again = run_merge(stale_out).data
    reduce, merged = again["passes"]["reduce"], again["passes"]["map"]
    # A unit that runs where the killed job read it finds its bytes there (which node read
    # what is not known to a new run: the others fetch again); the map pass fetches nothing.
    assert reduce["cache_bytes_read"] > 0
    assert merged["bytes_fetched"] == 0
    assert _fetched(server, "stale/") == models["header_reads"] + reduce["bytes_fetched"]
    assert _job_folders(nodes) == []


def test_plan_says_whether_the_cache_is_used(models, options, capsys):
    base, tasks = models["s3"]
    argv = ["plan", "--base", base, "--storage-options", json.dumps(options)]
    assert main(argv + sum([["--task", t] for t in tasks], [])) == 0
    assert "input cache: on (--input-cache auto)" in capsys.readouterr().out
    local_base, local_tasks = models["local"]
    argv = ["plan", "--base", str(local_base)] + sum([["--task", str(t)] for t in local_tasks], [])
    assert main(argv) == 0
    assert "input cache: off: every input is on a local filesystem" in capsys.readouterr().out


@CACHE_ROOM
def test_node_removed_during_map_pass(models, options, fs, nodes, monkeypatch):
    """Units sent back to a node that is gone run elsewhere and fetch their bytes again. The
    node is removed between the passes, after the reduce pass read (and kept) units there:
    no timing decides which units find it gone."""
    import ray

    base, tasks = models["s3"]
    config = _config(base, tasks, f"s3://{BUCKET}/removal", options, unit_budget_bytes=1024)
    lost = nodes["workers"][1]
    real_map_pass = driver.map_pass
    read_there: list[int] = []

    def map_pass_without_the_node(context, state, output):
        first_node = output.first_node
        read_there.append(sum(1 for n in first_node.values() if n == lost.node_id))
        nodes["cluster"].remove_node(lost)
        deadline = time.monotonic() + 60
        while any(n["NodeID"] == lost.node_id and n["Alive"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "Ray still sees the removed node"
            time.sleep(0.1)
        return real_map_pass(context, state, output)

    monkeypatch.setattr(driver, "map_pass", map_pass_without_the_node)
    reports = [run_merge(config).data]
    assert read_there and read_there[0] > 0  # the reduce pass kept units on that node
    merged = reports[0]["passes"]["map"]  # units meant for the lost node ran elsewhere
    assert merged["units_sent_back"] == merged["units"]
    assert merged["units_ran_there"] == merged["units"] - read_there[0]
    assert merged["bytes_fetched"] > 0
    fetched = Path(models["root"]) / "removal-fetched"
    fs.get(f"{BUCKET}/removal", str(fetched), recursive=True)
    expected, _ = reference_merge(*models["states"], "ram_plus")
    output = load_checkpoint(fetched)
    assert all(torch.equal(output[k], v) for k, v in expected.items())
    assert not list(nodes["tmpdirs"][0].glob(f"ram-dist-cache-{os.getuid()}/*"))
