"""gs:// in and out, for real: gcsfs over HTTP to a GCS emulator on 127.0.0.1, Ray workers."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from builders import INDEX_NAME, build_model_set, load_checkpoint, merge_config
from gcs_server import GcsServer, bucket_fs, running_gcs_server, storage_options
from reference import reference_merge
from s3_server import LOCATION_DEPENDENT, header_read_bytes

from ram_dist.api import run_merge
from ram_dist.errors import RamDistError
from ram_dist.io.storage import Storage
from ram_dist.io.verify import verify

BUCKET = "ram-dist-gcs-test"


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


@pytest.fixture(scope="module")
def models(tmp_path_factory, fs) -> dict:
    """Local inputs and the same inputs uploaded to the bucket."""
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    for d in [base_dir, *task_dirs]:
        for f in sorted(d.iterdir()):
            fs.put_file(str(f), f"{BUCKET}/in/{d.name}/{f.name}")
    files = [p for d in [base_dir, *task_dirs] for p in d.glob("*.safetensors")]
    return {
        "local": (base_dir, task_dirs),
        "gs": (f"gs://{BUCKET}/in/base", [f"gs://{BUCKET}/in/{d.name}" for d in task_dirs]),
        "states": (base, tasks),
        "header_bytes": sum(header_read_bytes(p) for p in files),  # the driver's reads
    }


def _merge(base, tasks, out, options=None, **kw) -> dict:
    kw.setdefault("unit_budget_bytes", 8192)
    return run_merge(merge_config(base, tasks, out, options, **kw)).data


@pytest.mark.usefixtures("ray_gcs")
def test_bucket_to_bucket_equals_reference_and_local_merge(models, options, fs, server, tmp_path):
    _merge(*models["local"], tmp_path / "local")
    server.clear()
    report = _merge(*models["gs"], f"gs://{BUCKET}/out", options)
    m = report["passes"]["map"]
    assert m["units"] > 3  # small units: several, over the workers
    # Workers upload their parts; the driver composes them: no shard byte through it.
    assert m["output_path"] == "direct" and "GCS" in m["output_path_reason"]
    assert m["bytes_written_by_workers"] == m["bytes_written"] > 0
    assert m["bytes_written_by_driver"] == 0
    problems, checked = verify(f"gs://{BUCKET}/out", Storage(options))
    assert problems == [] and checked > 1  # `ram-dist verify` re-hashes each shard

    # Inputs were read from the server as byte ranges only: each header once, then what the
    # passes fetched (the workers' reads, not the node-local input cache's).
    gets = [s for s in server.object_gets(BUCKET, "in/") if s.path.endswith(".safetensors")]
    assert gets and all(s.range is not None for s in gets)
    passes = report["passes"]["reduce"]["bytes_fetched"] + report["passes"]["map"]["bytes_fetched"]
    assert passes > 0 and sum(s.nbytes for s in gets) == passes + models["header_bytes"]

    # The output holds the index and every shard it names, and what a local merge writes.
    local = sorted(p.name for p in (tmp_path / "local").iterdir())
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/out", refresh=True))
    assert remote == local
    index = json.loads(fs.cat_file(f"{BUCKET}/out/{INDEX_NAME}"))
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards <= set(remote)

    # Downloaded, it is the local merge byte for byte (but for the files naming locations).
    out = tmp_path / "fetched"
    fs.get(f"{BUCKET}/out/", str(out), recursive=True)
    assert sorted(p.name for p in out.iterdir()) == local
    for name in local:
        if name not in LOCATION_DEPENDENT:
            assert (out / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name

    # And its tensors are the reference merge's.
    base, tasks = models["states"]
    expected, _ = reference_merge(base, tasks, "ram_plus")
    merged = load_checkpoint(out)
    assert merged.keys() == expected.keys()
    for name, want in expected.items():
        assert merged[name].dtype == want.dtype, name
        assert torch.equal(merged[name], want), name


def test_range_read_returns_the_rows_and_fetches_only_them(models, options, server):
    storage = Storage(options)
    local_dir = Path(models["local"][0])
    local_file = sorted(local_dir.glob("*.safetensors"))[0]
    data = local_file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    url = f"{models['gs'][0]}/{local_file.name}"
    ranges = [(url, 0, 8), (url, 8 + n + 100, 8 + n + 1124), (url, len(data) - 7, len(data))]
    ranges.append((url, 50, 50))  # empty: reads nothing

    server.clear()
    got = storage.read_ranges(ranges)
    assert [bytes(b) for b in got] == [data[s:e] for _, s, e in ranges]
    served = server.object_gets(BUCKET, f"in/base/{local_file.name}")
    assert sorted(s.nbytes for s in served) == [7, 8, 1024]
    assert all(s.range is not None for s in served)

    into = [memoryview(bytearray(e - s)) for _, s, e in ranges]
    got = storage.read_ranges(ranges, into)
    assert all(a is b for a, b in zip(got, into, strict=True))
    assert [bytes(b) for b in into] == [data[s:e] for _, s, e in ranges]


@pytest.mark.usefixtures("ray_gcs")
def test_missing_input_names_the_location(models, options, fs):
    base, tasks = models["gs"]
    missing = f"gs://{BUCKET}/in/no-such-agent"
    with pytest.raises(RamDistError, match=re.escape(missing)):
        _merge(base, [tasks[0], missing], f"gs://{BUCKET}/never", options)
    assert fs.find(f"{BUCKET}/never") == []
