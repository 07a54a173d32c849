"""Buckets in and out, for real: s3fs over HTTP to moto's server on 127.0.0.1, Ray workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import s3fs
import torch
from builders import build_model_set, load_checkpoint, merge_config, save_checkpoint
from reference import reference_merge
from s3_server import (
    LOCATION_DEPENDENT,
    header_read_bytes,
)

from ram_dist.api import run_merge
from ram_dist.engine.blocks import BlockStream
from ram_dist.engine.worker import worker_context
from ram_dist.errors import StorageError
from ram_dist.io.checkpoint import open_checkpoints
from ram_dist.io.storage import Storage
from ram_dist.planning.layout import build_layout
from ram_dist.planning.units import Piece

BUCKET = "ram-dist-test"


@pytest.fixture(scope="module")
def models(tmp_path_factory, fs) -> dict:
    """Local inputs and the same inputs uploaded to the bucket."""
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    for d in [base_dir, *task_dirs]:
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    files = [p for d in [base_dir, *task_dirs] for p in d.glob("*.safetensors")]
    return {
        "local": (base_dir, task_dirs),
        "s3": (f"s3://{BUCKET}/in/base", [f"s3://{BUCKET}/in/{d.name}" for d in task_dirs]),
        "states": (base, tasks),
        "input_bytes": sum(p.stat().st_size for p in files),
        "header_reads": sum(header_read_bytes(p) for p in files),
    }


def _merge(base, tasks, out, options=None, **kw) -> dict:
    kw.setdefault("unit_budget_bytes", 8192)
    return run_merge(merge_config(base, tasks, out, options, **kw)).data


@pytest.mark.usefixtures("ray_s3")
def test_bucket_to_bucket_equals_local_merge(models, options, fs, server, tmp_path):
    _merge(*models["local"], tmp_path / "local")
    server.clear()
    report = _merge(*models["s3"], f"s3://{BUCKET}/out", options)

    local = sorted(p.name for p in (tmp_path / "local").iterdir())
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/out", refresh=True))
    assert remote == local
    for name in local:
        if name not in LOCATION_DEPENDENT:
            assert fs.cat_file(f"{BUCKET}/out/{name}") == (tmp_path / "local" / name).read_bytes()
    base, tasks = models["states"]
    expected, _ = reference_merge(base, tasks, "ram_plus")
    out = tmp_path / "fetched"
    fs.get(f"{BUCKET}/out", str(out), recursive=True)
    assert all(torch.equal(load_checkpoint(out)[k], v) for k, v in expected.items())

    # Server side: what the passes fetched (not read from the input cache), plus each header
    # once; tests/end_to_end/test_input_cache.py checks the cache's share of it.
    gets = [s for s in server.object_gets(f"{BUCKET}/in/") if s.path.endswith(".safetensors")]
    assert all(s.range is not None for s in gets)  # range requests only
    headers = models["header_reads"]
    passes = report["passes"]["reduce"]["bytes_fetched"] + report["passes"]["map"]["bytes_fetched"]
    assert sum(s.nbytes for s in gets) == passes + headers
    assert passes + headers <= 2 * models["input_bytes"] + headers
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(remote)


def test_range_read_fetches_only_the_rows_and_the_header(models, options, server):
    storage = Storage(options)
    base_url = models["s3"][0]
    server.clear()
    [ckpt] = open_checkpoints([(base_url, "base model")], storage)
    info = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]  # [64, 128] bf16
    key = info.file.removeprefix("s3://")
    local_file = Path(models["local"][0]) / key.rsplit("/", 1)[-1]
    header_gets = [s for s in server.object_gets() if s.path == "/" + key]
    # One request: the length, the header, and what follows it up to 256 KiB (a tiny file
    # is read whole; a real shard's tensor bytes are not)
    assert len(header_gets) == 1
    assert sum(s.nbytes for s in header_gets) == header_read_bytes(local_file)

    server.clear()
    layout = build_layout(ckpt, [ckpt, ckpt], None)
    rows = Piece(info.name, 10 * 128, 13 * 128)  # rows 10..12
    read = [0, 0, 0]
    with worker_context().work() as scope:
        blocks = list(BlockStream((rows,), layout, storage, read, scope))
        assert len(blocks) == 1
        base_rows = bytes(blocks[0][1].raw[0])
    served = [s for s in server.object_gets() if s.path == "/" + key]
    assert sum(s.nbytes for s in served) == 3 * 3 * 128 * 2  # three inputs, three bf16 rows
    assert read == [3 * 128 * 2] * 3
    want = load_checkpoint(models["local"][0])[info.name][10:13].reshape(-1)
    assert base_rows == want.view(torch.uint8).numpy().tobytes()


@pytest.mark.usefixtures("ray_s3")
def test_failure_while_uploading_a_shard_leaves_nothing(options, fs, tmp_path):
    """A writer that raises after the first multipart part: no shard, no index, no upload."""
    g = torch.Generator().manual_seed(0)
    base = {
        "big": torch.randn(2048, 1024, generator=g),  # 8 MiB: more than one 5 MiB part
        "small": torch.randn(16, generator=g),
    }
    tasks = [{k: v + (torch.rand(v.shape, generator=g) < 0.3) * 0.1 for k, v in base.items()}]
    tasks.append({k: v + (torch.rand(v.shape, generator=g) < 0.5) * 0.1 for k, v in base.items()})
    for name, state in [("base", base), ("t0", tasks[0]), ("t1", tasks[1])]:
        save_checkpoint(state, tmp_path / name)
    failing = {"s3fail": dict(options["s3"], default_block_size=5 * 2**20)}
    FailingS3FileSystem.clear_instance_cache()
    with pytest.raises(StorageError, match="model.safetensors: cannot write: .*injected") as e:
        _merge(
            tmp_path / "base",
            [tmp_path / "t0", tmp_path / "t1"],
            f"s3fail://{BUCKET}/failed",
            failing,
            unit_budget_bytes=2**20,
        )
    assert e.value.exit_status == 1  # a broken connection may pass: run again
    assert FailingS3File.parts_uploaded >= 1
    left = [p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/failed")]
    assert "model.safetensors" not in left and "model.safetensors.index.json" not in left
    assert left == ["ram_dist_manifest.json"]  # the reduce statistics, kept for a re-run
    manifest = json.loads(fs.cat_file(f"{BUCKET}/failed/ram_dist_manifest.json"))
    assert manifest["shards"] == {} and not manifest["complete"]
    uploads = fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])
    assert [u for u in uploads if u["Key"].startswith("failed/")] == []


class FailingS3File(s3fs.core.S3File):
    parts_uploaded = 0

    def _upload_chunk(self, final: bool = False) -> bool:
        if self.parts:
            FailingS3File.parts_uploaded = len(self.parts)
            raise ConnectionError("injected: the upload broke after its first part")
        return super()._upload_chunk(final)


class FailingS3FileSystem(s3fs.S3FileSystem):
    protocol = ("s3fail",)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode:
            f.__class__ = FailingS3File
        return f


@pytest.fixture(autouse=True, scope="module")
def _register_failing_protocol() -> None:
    import fsspec

    fsspec.register_implementation("s3fail", FailingS3FileSystem, clobber=True)


def test_dry_run_leaves_the_bucket_untouched(models, options, fs, server):
    from ram_dist.cli import main

    base, tasks = models["s3"]
    server.clear()
    argv = ["plan", "--base", base, "--out", f"s3://{BUCKET}/dry", "--storage-options"]
    argv += [json.dumps(options)] + sum([["--task", t] for t in tasks], [])
    assert main(argv) == 0
    assert fs.find(f"{BUCKET}/dry") == []
    writes = [s for s in server.log if s.method in ("PUT", "POST", "DELETE")]
    assert writes == []
