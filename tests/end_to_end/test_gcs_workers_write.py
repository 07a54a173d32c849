"""GCS outputs written by the workers, tried for real: gcsfs over HTTP to the GCS emulator
behind the test server's checks (preconditions, compose's 32 sources: `gcs_server`), a real
local Ray. Each worker uploads its part as an object under `<output>/.ram-dist-parts/`, the
driver composes the shard; a job killed mid-shard resumes with the parts it uploaded; a second
writer is refused by the store's conditional write; throttling answers are retried; an input
deleted mid-run stops the job with one line and nothing published.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import torch
from big_model import build_big_set
from builders import INDEX_NAME, build_model_set, load_checkpoint
from gcs_server import PARTS_DIR, GcsServer, bucket_fs, running_gcs_server, storage_options
from killing import kill_once_recorded
from reference import reference_merge

from ram_dist.api import run_merge
from ram_dist.cli import main
from ram_dist.errors import RamDistError
from ram_dist.io.lease import LEASE_NAME
from ram_dist.io.lease.gcs import GcsStore
from ram_dist.io.sinks.gcs import PART_SUFFIX, GcsSink
from ram_dist.io.storage import Storage
from ram_dist.io.verify import verify
from ram_dist.planning.config import MergeConfig

BUCKET = "gcs-workers"
MANIFEST = "ram_dist_manifest.json"


@pytest.fixture(scope="module")
def server() -> Iterator[GcsServer]:
    with running_gcs_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def options(server) -> dict:
    return storage_options()


@pytest.fixture(scope="module")
def fs(options):
    return bucket_fs(options, BUCKET)


@pytest.fixture(scope="module")
def ray_gcs(server, own_ray) -> Iterator[None]:
    """A real local Ray of the module's own, started inside the server's environment (its
    workers inherit it)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _upload(fs, folders: list[Path], prefix: str) -> list[str]:
    for d in folders:
        for f in sorted(d.iterdir()):
            fs.put_file(str(f), f"{BUCKET}/{prefix}/{d.name}/{f.name}")
    return [f"gs://{BUCKET}/{prefix}/{d.name}" for d in folders]


@pytest.fixture(scope="module")
def big(tmp_path_factory, fs) -> dict:
    """Two 12 MiB shards and a small one: many parts per shard."""
    made = build_big_set(tmp_path_factory.mktemp("big"))
    urls = _upload(fs, [made["base"], *made["tasks"]], "big")
    return {"gs": (urls[0], urls[1:]), "expected": made["expected"]}


@pytest.fixture(scope="module")
def small(tmp_path_factory, fs) -> dict:
    root = tmp_path_factory.mktemp("small")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    urls = _upload(fs, [base_dir, *task_dirs], "small")
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"gs": (urls[0], urls[1:]), "expected": expected, "tasks": task_dirs}


def _config(models: dict, out: str, options: dict, **kw) -> MergeConfig:
    base, tasks = models["gs"]
    kw.setdefault("unit_budget_bytes", 8192)
    return MergeConfig(base=base, tasks=tuple(tasks), out=out, storage_options=options, **kw)


def _argv(models: dict, out: str, options: dict, *extra: str) -> list[str]:
    base, tasks = models["gs"]
    argv = ["merge", "--base", base, "--out", out, "--storage-options", json.dumps(options)]
    for t in tasks:
        argv += ["--task", t]
    return [*argv, *extra]


def _cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _same_as(fs, out: str, expected: dict, tmp_path: Path) -> None:
    local = tmp_path / out.replace("/", "-")
    fs.get(f"{BUCKET}/{out}/", str(local), recursive=True)
    merged = load_checkpoint(local)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


def _finished(fs, out: str) -> dict:
    return json.loads(fs.cat_file(f"{BUCKET}/{out}/{MANIFEST}"))["shards"]


@pytest.mark.usefixtures("ray_gcs")
def test_killed_mid_shard_resumes_with_its_parts_and_composes_in_levels(
    big, options, fs, server, tmp_path, capsys
):
    """Parts of 256 KiB (GCS's sink takes parts that small): a 12 MiB shard has more than
    the 32 sources one compose takes. The whole job (driver and its workers) is SIGKILLed
    once a part of an unfinished shard is recorded: nothing at the shard's name, no index,
    only hidden parts. The re-run reuses every recorded part (none uploaded again), then
    composes groups of parts under the hidden prefix, then each shard, and deletes them."""
    out = f"gs://{BUCKET}/killed"
    argv = _argv(big, out, options, "--unit-mb", str(2**17 / 2**20), "--workers", "1")
    args = [sys.executable, "-m", "ram_dist.cli", *argv]

    server.clear()
    server.part_delay_s = 0.2  # a shard's parts take longer than a manifest save
    try:
        manifest = kill_once_recorded(
            args, _cli_env(), lambda: fs.cat_file(f"{BUCKET}/killed/{MANIFEST}")
        )
    finally:
        server.part_delay_s = 0.0
    time.sleep(1.0)  # a part the server was still receiving ends either way
    kept = {
        f"killed/{PARTS_DIR}/{name}/{w['upload_id']}/{int(n):05d}{PART_SUFFIX}"
        for name, w in manifest["writing"].items()
        for n in w["parts"]
    }
    left = server.names(BUCKET, "killed/")
    assert kept <= set(left)
    unfinished = [n for n in manifest["shard_names"] if n not in manifest["shards"]]
    assert unfinished and not any(f"killed/{n}" in left for n in unfinished)
    assert f"killed/{INDEX_NAME}" not in left

    server.clear()
    assert main(argv) == 0, capsys.readouterr().err  # on this process's Ray
    uploads = server.part_uploads()
    assert not kept & set(uploads), "a recorded part was uploaded again"
    report = json.loads(fs.cat_file(f"{BUCKET}/killed/merge_report.json"))
    m = report["passes"]["map"]
    assert report["passes"]["reduce"]["skipped"] is True
    assert m["parts_reused"] >= len(kept) > 0 and m["parts"] == len(uploads)
    assert m["output_path"] == "direct" and m["bytes_written_by_driver"] == 0
    reused = sum(p["stop"] - p["start"] for w in manifest["writing"].values()
                 for p in w["parts"].values())  # fmt: skip
    assert m["bytes_written_by_workers"] == m["bytes_written"] - reused > 0

    per_shard = Counter(name.split("/")[2] for name in [*uploads, *kept])
    assert max(per_shard.values()) > 32, per_shard
    composes = [s for s in server.log if s.path.endswith("/compose")]
    assert composes and all(s.status == 200 for s in composes)
    levels = [s for s in composes if f"/{PARTS_DIR}/" in unquote(s.path)]
    assert levels, "no intermediate composite"
    shards = set(json.loads(fs.cat_file(f"{BUCKET}/killed/{INDEX_NAME}"))["weight_map"].values())
    assert {unquote(s.path).rsplit("/", 2)[-2] for s in composes if s not in levels} == shards

    assert server.names(BUCKET, f"killed/{PARTS_DIR}/") == []  # parts deleted once composed
    _same_as(fs, "killed", big["expected"], tmp_path)
    assert verify(out, Storage(options)) == ([], 3)


@dataclass(frozen=True)
class _Part:
    shard: str
    number: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def test_a_part_or_shard_changed_meanwhile_is_not_published(options, fs, server):
    """The compose's preconditions (each part at the generation its upload returned, the
    shard's name at the one seen when it was opened): a part replaced after its upload (a
    stale run's straggler), or a shard another run wrote meanwhile, fails the compose with
    one message; the shard's name keeps what it held."""
    storage = Storage(options)
    sink = GcsSink.choose(f"gs://{BUCKET}/guarded", storage, shared=False, single_node=None)
    data = np.random.default_rng(0).integers(0, 256, 3 * 1000, dtype=np.uint8)

    def written(name: str):
        plan = [_Part(name, n, (n - 1) * 1000, n * 1000) for n in (1, 2, 3)]
        shard = sink.open(name, len(data), plan, None)
        for p in plan:
            chunk = data[p.start : p.stop]
            shard.done[p.number] = shard.target.write(p, chunk, hashlib.sha256(chunk).digest())
        return shard

    shard = written("a.safetensors")
    fs.pipe_file(f"{BUCKET}/{shard.target.prefix}{2:05d}{PART_SUFFIX}", data[1000:2000].tobytes())
    with pytest.raises(RamDistError, match="changed while this run wrote it"):
        sink.complete(shard)
    assert not fs.exists(f"{BUCKET}/guarded/a.safetensors")

    shard = written("b.safetensors")
    fs.pipe_file(f"{BUCKET}/guarded/b.safetensors", b"another run's")
    with pytest.raises(RamDistError, match="changed while this run wrote it"):
        sink.complete(shard)
    assert fs.cat_file(f"{BUCKET}/guarded/b.safetensors") == b"another run's"

    shard = written("c.safetensors")
    sink.complete(shard)
    assert fs.cat_file(f"{BUCKET}/guarded/c.safetensors") == data.tobytes()
    assert server.names(BUCKET, f"guarded/{PARTS_DIR}/c.safetensors/") == []


def test_the_lease_is_made_exclusive_by_the_store(options, fs, server):
    """Create, renew and release only at the generation last seen: the emulator (behind the
    test server's preconditions) refuses the rest with 412."""
    storage = Storage(options)
    url = f"gs://{BUCKET}/leased/{LEASE_NAME}"
    gfs, path = storage.fs(url)
    one, two = GcsStore.for_location(url, gfs, path), GcsStore.for_location(url, gfs, path)
    assert isinstance(one, GcsStore)
    first = one.create(b'{"a": 1}')
    assert first is not None and two.create(b'{"b": 2}') is None
    seen = two.read()
    assert seen is not None and seen.version == first and seen.modified is not None
    second = one.replace(b'{"a": 2}', first)
    assert second not in (None, first)
    assert two.replace(b'{"b": 3}', first) is None  # a stale generation
    assert two.remove(first) is False and one.read().version == second
    assert one.remove(second) is True and one.read() is None
    refused = [s for s in server.log if s.status == 412 and s.object == f"leased/{LEASE_NAME}"]
    assert len(refused) >= 2


@pytest.mark.usefixtures("ray_gcs")
def test_a_second_writer_is_refused_by_the_lease(small, options, fs, server, capsys, tmp_path):
    """The first writer is held at its first part upload (the server waits) while a second
    merge into the same output starts: the store refuses its lease, it exits with status 2."""
    out = f"gs://{BUCKET}/two"
    results: list[dict] = []
    errors: list[BaseException] = []
    held, release = threading.Event(), threading.Event()

    def hold_first_part(method: str, path: str, query: dict) -> None:
        if PARTS_DIR in (query.get("name") or [""])[0] and not release.is_set():
            held.set()
            release.wait(120)

    def first() -> None:
        try:
            results.append(run_merge(_config(small, out, options)).data)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    server.intercept = hold_first_part
    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert held.wait(120), errors
        server.clear()
        code = main(_argv(small, out, options))
        assert thread.is_alive(), "the first writer ended before the second tried"
    finally:
        release.set()
        server.intercept = None
        thread.join(timeout=300)
    err = capsys.readouterr().err
    assert code == 2 and f"{out}/{LEASE_NAME}: the output location is held by" in err, err
    tries = [s for s in server.log if s.object == f"two/{LEASE_NAME}"]
    assert tries and tries[0].status == 412  # the store refused the second create
    assert not errors and results[0]["passes"]["map"]["bytes_written_by_driver"] == 0
    assert LEASE_NAME not in [n.rsplit("/", 1)[-1] for n in server.names(BUCKET, "two/")]
    _same_as(fs, "two", small["expected"], tmp_path)


@pytest.mark.usefixtures("ray_gcs")
def test_throttling_answers_are_retried(small, options, fs, server, tmp_path):
    """Every fourth request answered 503 or 429 (six times): gcsfs retries each, on the
    driver and on the workers, and the merge is exact."""
    served = [0]
    faults: list[int] = []

    def throttle(method: str, path: str, query: dict) -> int | None:
        served[0] += 1
        if served[0] % 4 == 0 and len(faults) < 6:
            faults.append(503 if len(faults) % 2 else 429)
            return faults[-1]
        return None

    server.intercept = throttle
    try:
        report = run_merge(_config(small, f"gs://{BUCKET}/throttled", options)).data
    finally:
        server.intercept = None
    assert len(faults) == 6 and {429, 503} == set(faults)
    m = report["passes"]["map"]
    assert m["bytes_written_by_driver"] == 0 and m["bytes_written_by_workers"] > 0
    assert server.names(BUCKET, f"throttled/{PARTS_DIR}/") == []
    _same_as(fs, "throttled", small["expected"], tmp_path)


@pytest.mark.usefixtures("ray_gcs")
def test_an_input_deleted_mid_run_stops_it_with_nothing_published(
    small, options, fs, server, capsys
):
    """Deleted when the first part is uploaded (the map pass runs; no input cache, so the
    workers read the store): one line naming the file, no index, no lease, no shard at its
    name but those the manifest records as finished, the rest only hidden parts."""
    victim_file = sorted(small["tasks"][0].glob("*.safetensors"))[-1].name
    victim = f"small/{small['tasks'][0].name}/{victim_file}"
    fired: list[bool] = []

    def on_first_part(method: str, path: str, query: dict) -> None:
        if not fired and PARTS_DIR in (query.get("name") or [""])[0]:
            fired.append(True)
            server.delete(BUCKET, victim)

    out = f"gs://{BUCKET}/deleted"
    server.intercept = on_first_part
    try:
        argv = _argv(small, out, options, "--input-cache", "off", "--unit-mb", "0.0078125")
        code = main(argv)
    finally:
        server.intercept = None
        fs.put_file(str(small["tasks"][0] / victim_file), f"{BUCKET}/{victim}")
    err = capsys.readouterr().err
    assert fired and code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ram-dist: error: "), err
    assert f"input gs://{BUCKET}/{victim}: cannot read: no such file" in lines[0]
    names = [n[len("deleted/") :] for n in server.names(BUCKET, "deleted/")]
    assert INDEX_NAME not in names and LEASE_NAME not in names
    finished = _finished(fs, "deleted") if MANIFEST in names else {}
    shown = {n for n in names if n.endswith(".safetensors")}  # part objects are numbered
    assert shown <= set(finished)
