"""Opening checkpoints costs a few requests per folder and one per file, sent together.

Counted on moto's S3 server over HTTP: one listing and one index read per checkpoint, one
ranged GET per shard (two for a header longer than the first read), and the GETs of all
shards of all checkpoints in flight at once. The result is what the sequential reader this
replaced gave, identities included (resume compares them across runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs
import torch
from builders import save_checkpoint
from s3_server import (
    CountingMotoServer,
    Served,
    bucket_fs,
    header_read_bytes,
    running_server,
    storage_options,
)

from ram_dist.errors import CheckpointError
from ram_dist.io import header_reads
from ram_dist.io.checkpoint import INDEX_NAME, Checkpoint, open_checkpoints
from ram_dist.io.header_reads import FIRST_READ_BYTES, read_file_headers
from ram_dist.io.safetensors_header import header_length, parse_header
from ram_dist.io.storage import Storage, join

BUCKET = "header-reads"
SHARDS = 50
ROLES = ("base", "t1", "t2", "t3")


@pytest.fixture(scope="module")
def server() -> Iterator[CountingMotoServer]:
    with running_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def fs(server) -> s3fs.S3FileSystem:
    return bucket_fs(storage_options(server), BUCKET)


@pytest.fixture(scope="module")
def storage(server) -> Storage:
    return Storage(storage_options(server))


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.w{j}.weight": torch.randn(3, 2, generator=g).to(torch.bfloat16)
        for i in range(SHARDS)
        for j in range(2)
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory, fs) -> dict[str, list[str]]:
    """Base and three tasks of 50 shards each (two tensors a shard), locally and in the bucket,
    and a single-file checkpoint whose header is longer than the first read."""
    root = tmp_path_factory.mktemp("ckpts")
    for k, role in enumerate(ROLES):
        save_checkpoint(_state(k), root / role, max_shard_bytes=2 * 3 * 2 * 2)
        assert len(list((root / role).glob("*.safetensors"))) == SHARDS
    names = [f"model.layers.{i}.{'very_long_module_name_' * 6}{i}.weight" for i in range(2000)]
    save_checkpoint({n: torch.zeros(1, dtype=torch.bfloat16) for n in names}, root / "wide")
    (n,) = struct.unpack("<Q", (root / "wide" / "model.safetensors").read_bytes()[:8])
    assert n > FIRST_READ_BYTES
    for role in (*ROLES, "wide"):
        fs.put(str(root / role), f"{BUCKET}/{role}", recursive=True)
    return {
        "local": [str(root / role) for role in ROLES],
        "s3": [f"s3://{BUCKET}/{role}" for role in ROLES],
        "wide": [str(root / "wide"), f"s3://{BUCKET}/wide"],
    }


def _inputs(urls: list[str]) -> list[tuple[str, str]]:
    return [(urls[0], "base model"), *((u, f"task {i}") for i, u in enumerate(urls[1:], 1))]


def _sequential(url: str, label: str, storage: Storage) -> Checkpoint:
    """The reader this replaced, file by file: `fs.info`, the 8-byte length, the JSON."""
    fs, path = storage.fs(url)
    sharded = fs.exists(join(path, INDEX_NAME))
    if sharded:
        files = tuple(
            dict.fromkeys(json.loads(fs.cat_file(join(path, INDEX_NAME)))["weight_map"].values())
        )
    else:
        files = ("model.safetensors",)
    tensors, identity = {}, {}
    for file in files:
        info = fs.info(join(path, file))
        size = int(info["size"])
        n = header_length(fs.cat_file(join(path, file), start=0, end=8), file, size)
        body = fs.cat_file(join(path, file), start=8, end=8 + n)
        header = parse_header(body, join(url, file), size)
        tensors.update(header.tensors)
        version = header_reads.file_version(info)
        identity[file] = {"size": size, "header_sha256": header.header_sha256, "version": version}
    return Checkpoint(url, label, files, tensors, sharded, identity)


def _shard_gets(server: CountingMotoServer) -> Counter[str]:
    return Counter(s.path for s in server.object_gets(BUCKET) if s.path.endswith(".safetensors"))


def _listings(server: CountingMotoServer) -> list[Served]:
    return [s for s in server.log if s.method == "GET" and "list-type" in s.query]


def test_one_get_per_shard_one_listing_per_folder(folders, storage, server):
    server.clear()
    opened = open_checkpoints(_inputs(folders["s3"]), storage)
    assert [len(c.files) for c in opened] == [SHARDS] * 4
    gets = _shard_gets(server)
    assert len(gets) == 4 * SHARDS and set(gets.values()) == {1}  # one GET a shard, no more
    assert len(_listings(server)) == 4  # one listing per folder, not per file
    indexes = [s for s in server.object_gets(BUCKET) if s.path.endswith(INDEX_NAME)]
    assert len(indexes) == 4
    assert not [s for s in server.log if s.method == "HEAD"]  # sizes came with the listing
    assert len(server.log) == 4 + 4 + 4 * SHARDS
    local = {f"/{BUCKET}/{p.parent.name}/{p.name}": p
             for d in folders["local"] for p in Path(d).iterdir()}  # fmt: skip
    for s in server.object_gets(BUCKET):  # a small file (shard, index) is read whole, at once
        size = local[s.path].stat().st_size
        assert s.range == f"bytes=0-{size - 1}" and s.nbytes == size < FIRST_READ_BYTES
        if s.path.endswith(".safetensors"):
            assert s.nbytes == header_read_bytes(local[s.path])


def test_same_checkpoints_as_the_sequential_reader(folders, storage):
    inputs = _inputs(folders["local"])
    assert open_checkpoints(inputs, storage) == [_sequential(*i, storage) for i in inputs]
    inputs = _inputs(folders["s3"])
    opened = open_checkpoints(inputs, storage)
    for k in (0, 3):  # on S3, the base and the last task (the old way takes a while)
        assert opened[k] == _sequential(*inputs[k], storage)
    s3_base = open_checkpoints([(folders["s3"][0], "base model")], storage)[0]
    version = next(iter(s3_base.identity.values()))["version"]
    assert version.startswith('ETag:"') and version.endswith('"')  # as s3fs's HEAD gives it
    local = open_checkpoints([(folders["local"][0], "base model")], storage)[0]
    assert next(iter(local.identity.values()))["version"].startswith("mtime:")


def test_all_headers_in_flight_together(folders, storage, server):
    delay = 0.05
    server.get_delay_s = delay
    try:
        server.clear()
        open_checkpoints(_inputs(folders["s3"]), storage)
    finally:
        server.get_delay_s = 0.0
    served = [s for s in server.object_gets(BUCKET) if s.path.endswith(".safetensors")]
    assert len(served) == 4 * SHARDS
    # Server side: how many requests it was handling at the busiest moment.
    events = sorted([(s.started, 1) for s in served] + [(s.finished, -1) for s in served])
    busiest = max(sum(step for _, step in events[: k + 1]) for k in range(len(events)))
    assert busiest >= 8, busiest  # s3fs's pool: 10 connections by default


def test_a_header_longer_than_the_first_read_takes_two_gets(folders, storage, server):
    local, remote = folders["wide"]
    server.clear()
    opened = open_checkpoints([(remote, "wide")], storage)[0]
    gets = [s for s in server.object_gets(BUCKET) if s.path.endswith(".safetensors")]
    path = Path(local) / "model.safetensors"
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert [s.range for s in gets] == [
        f"bytes=0-{FIRST_READ_BYTES - 1}",
        f"bytes={FIRST_READ_BYTES}-{8 + n - 1}",  # the rest of the header only
    ]
    assert sum(s.nbytes for s in gets) == 8 + n == header_read_bytes(path)
    assert len(opened.tensors) == 2000
    assert opened == _sequential(remote, "wide", storage)
    assert open_checkpoints([(local, "wide")], storage)[0] == _sequential(local, "wide", storage)


def test_missing_files_read_as_before(folders, storage, server):
    gone = f"s3://{BUCKET}/base/model-99999-of-99999.safetensors"
    with pytest.raises(CheckpointError, match=f"^{re.escape(gone)}: file not found$"):
        read_file_headers([gone], storage)
    # Listed, then deleted before its read: the GET's 404 says the same.
    with pytest.raises(CheckpointError, match=f"^{re.escape(gone)}: file not found$"):
        read_file_headers([gone], storage, [{"name": gone, "size": 100, "type": "file"}])
    # A file of the batch that fails is reported; the first in order when several do.
    good = join(folders["s3"][0], open_checkpoints([(folders["s3"][0], "b")], storage)[0].files[0])
    with pytest.raises(CheckpointError, match="99999-of-99999.safetensors: file not found"):
        read_file_headers([good, gone, gone.replace("99999-of", "99998-of")], storage)


def test_a_synchronous_remote_store_reads_in_threads():
    """HfFileSystem is synchronous: its reads go to threads, without a read-ahead cache."""

    class SlowSyncStore:
        protocol = ("hf",)
        async_impl = False

        def __init__(self) -> None:
            self.kwargs: list[dict] = []
            self.now = self.busiest = 0
            self.lock = threading.Lock()

        def cat_file(self, path, start, end, **kwargs):
            with self.lock:
                self.kwargs.append(kwargs)
                self.now += 1
                self.busiest = max(self.busiest, self.now)
            time.sleep(0.05)
            with self.lock:
                self.now -= 1
            return path.encode()[start:end]

    store = SlowSyncStore()
    paths = [f"org/name/f{i:02d}" for i in range(32)]
    out = header_reads._cat_ranges(store, paths, [0] * 32, [9] * 32)
    assert out == [p.encode()[:9] for p in paths]
    assert store.busiest >= 8, store.busiest
    assert all(k == {"cache_type": "none"} for k in store.kwargs)


def test_a_symlinked_shard_keeps_its_targets_version(folders, storage, tmp_path):
    """A Hugging Face cache snapshot links each file to a blob: the listing stats the link,
    but the identity has always held the blob's mtime (what `fs.info` gives)."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(folders["local"][0], blobs)
    snapshot.mkdir()
    for blob in blobs.iterdir():
        link = snapshot / blob.name
        link.symlink_to(blob)
        os.utime(link, (1e9, 1e9), follow_symlinks=False)  # the link is older than its blob
    opened = open_checkpoints([(str(snapshot), "base model")], storage)[0]
    assert opened.identity == _sequential(str(snapshot), "base model", storage).identity
    mtime = (blobs / opened.files[0]).stat().st_mtime
    assert opened.identity[opened.files[0]]["version"] == f"mtime:{mtime}"
