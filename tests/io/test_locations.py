"""Where checkpoints live: URL forms, Hugging Face ids from the local cache, retried reads."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator

import gcsfs
import pytest
import s3fs
import torch
from builders import load_checkpoint, save_checkpoint
from huggingface_hub import HfFileSystem
from reference import reference_merge

from ram_dist.errors import RamDistError, StorageError
from ram_dist.io.locations import resolve_location
from ram_dist.io.storage import ATTEMPTS, Storage, join


def test_url_forms_resolve_to_the_right_filesystem_and_path(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_location("s3://bucket/models/base/", "base") == "s3://bucket/models/base"
    assert resolve_location("org/name", "base") == "hf://org/name"
    assert resolve_location("org/name@v1.0", "base") == "hf://org/name@v1.0"
    assert resolve_location("org/name@refs/pr/3", "base") == "hf://org/name@refs%2Fpr%2F3"
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert resolve_location("org/local", "base") == str(tmp_path / "org" / "local")
    assert resolve_location("./x", "base") == str(tmp_path / "x")

    storage = Storage({"gs": {"token": "anon"}})  # anonymous: no credential lookup at all
    fs, path = storage.fs(join("gs://bucket/prefix", "model.safetensors"))
    assert isinstance(fs, gcsfs.GCSFileSystem) and path == "bucket/prefix/model.safetensors"
    fs, path = storage.fs(join("hf://org/name@v1.0", "model.safetensors"))
    assert isinstance(fs, HfFileSystem) and path == "org/name@v1.0/model.safetensors"
    fs, path = storage.fs("s3://bucket/key")
    assert isinstance(fs, s3fs.S3FileSystem) and path == "bucket/key"


def test_storage_options_never_show_their_values():
    storage = Storage({"s3": {"key": "AKIA-SECRET", "secret": "hunter2"}})
    assert "hunter2" not in repr(storage) and "AKIA-SECRET" not in repr(storage)
    with pytest.raises(RamDistError, match="map a protocol"):
        Storage({"endpoint_url": "http://x"})  # type: ignore[dict-item]


def _cache_model(hub, repo: str, src, revision: str = "main") -> None:
    sha = f"{abs(hash((repo, revision))):040x}"[:40]
    root = hub / f"models--{repo.replace('/', '--')}"
    shutil.copytree(src, root / "snapshots" / sha)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(sha)


def _states():
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(16, 8, generator=g).to(torch.bfloat16)}
    tasks = [
        {"w": (base["w"].float() + (torch.rand(16, 8, generator=g) < p) * 0.5).to(torch.bfloat16)}
        for p in (0.2, 0.5, 0.6)
    ]
    return base, tasks


def test_hugging_face_ids_from_the_local_cache_offline(tmp_path):
    base, tasks = _states()
    hub = tmp_path / "hub"
    for name, state in [("base", base), *[(f"agent{i}", t) for i, t in enumerate(tasks)]]:
        save_checkpoint(state, tmp_path / "src" / name)
        (tmp_path / "src" / name / "config.json").write_text('{"model_type": "llama"}')
    _cache_model(hub, "org/base", tmp_path / "src" / "base")
    _cache_model(hub, "org/agent0", tmp_path / "src" / "agent0")
    _cache_model(hub, "org/agent1", tmp_path / "src" / "agent1", revision="v1")
    _cache_model(hub, "org/agent2", tmp_path / "src" / "agent2")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    cli = [sys.executable, "-m", "ram_dist.cli", "merge", "--base", "org/base"]
    tasks_args = ["--task", "org/agent0", "--task", "org/agent1@v1", "--task", "org/agent2"]
    done = subprocess.run(
        [*cli, *tasks_args, "--out", str(tmp_path / "out")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected, _ = reference_merge(base, tasks, "ram_plus")
    assert torch.equal(load_checkpoint(tmp_path / "out")["w"], expected["w"])
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "llama"}'

    missing = [*cli, "--task", "org/agent0", "--task", "org/nope@v2", "--out", tmp_path / "o2"]
    done = subprocess.run(
        [str(a) for a in missing], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "task 2: Hugging Face model org/nope@v2 is not in the local cache" in done.stderr
    assert not (tmp_path / "o2").exists()


class _FlakyHandler(http.server.BaseHTTPRequestHandler):
    """Serves one file by byte range; the first `failures` requests answer 503."""

    data = bytes(range(256)) * 64
    failures = 0
    requests: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802
        type(self).requests.append(self.headers.get("Range"))
        if self.path != "/blob.bin":
            self.send_error(404)
            return
        if type(self).failures > 0:
            type(self).failures -= 1
            self.send_error(503, "slow down")
            return
        start, end = self.headers["Range"].removeprefix("bytes=").split("-")
        body = self.data[int(start) : int(end) + 1]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.data)}")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_transient_errors_are_retried_and_missing_files_are_not(flaky_server):
    _FlakyHandler.failures, _FlakyHandler.requests = 2, []
    storage = Storage()
    blob = storage.read_ranges([(f"{flaky_server}/blob.bin", 100, 1100)])[0]
    assert blob == _FlakyHandler.data[100:1100]
    assert _FlakyHandler.requests == ["bytes=100-1099"] * 3  # two 503s, then the bytes

    _FlakyHandler.requests = []
    with pytest.raises(StorageError, match="nope.bin: cannot read: no such file") as missing:
        storage.read_ranges([(f"{flaky_server}/nope.bin", 0, 10)])
    assert missing.value.exit_status == 2
    assert len(_FlakyHandler.requests) == 1  # a 404 is not retried

    _FlakyHandler.failures, _FlakyHandler.requests = 10, []
    with pytest.raises(StorageError, match="blob.bin: cannot read: the store failed") as failed:
        storage.read_ranges([(f"{flaky_server}/blob.bin", 100, 1100)])
    assert failed.value.exit_status == 1
    assert len(_FlakyHandler.requests) == ATTEMPTS  # then it gives up, naming the file


def test_ranges_that_follow_each_other_are_read_together(tmp_path, flaky_server, monkeypatch):
    """Ranges adjacent in a file, in any order: one `preadv` into their buffers (a local file,
    opened once) or one request (remote); each range still gets exactly its own bytes."""
    spans = [(300, 400), (100, 200), (200, 300), (500, 500), (600, 700), (650, 660), (0, 9000)]
    (tmp_path / "blob.bin").write_bytes(_FlakyHandler.data)
    calls: list[tuple[int, list[int]]] = []
    opened: list[str] = []
    preadv, open_ = os.preadv, os.open

    def counting_preadv(fd, bufs, at):
        calls.append((at, [len(b) for b in bufs]))
        return preadv(fd, bufs, at)

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return open_(path, *args, **kwargs)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(os, "open", counting_open)
    storage = Storage()
    want = [_FlakyHandler.data[a:b] for a, b in spans]
    local = str(tmp_path / "blob.bin")
    into = [memoryview(bytearray(b - a)) for a, b in spans]
    got = storage.read_ranges([(local, a, b) for a, b in spans], into=into)
    assert [bytes(g) for g in got] == [bytes(b) for b in into] == want
    assert opened == [local]
    assert calls == [(0, [9000]), (100, [100, 100, 100]), (600, [100]), (650, [10])]

    _FlakyHandler.failures, _FlakyHandler.requests = 0, []
    blobs = storage.read_ranges([(f"{flaky_server}/blob.bin", a, b) for a, b in spans])
    assert [bytes(b) for b in blobs] == want
    assert sorted(_FlakyHandler.requests) == sorted(
        ["bytes=0-8999", "bytes=100-399", "bytes=600-699", "bytes=650-659"]
    )

    (tmp_path / "short.bin").write_bytes(bytes(150))
    with pytest.raises(StorageError, match="short.bin: .*short read of \\[100, 300\\): 50 bytes"):
        storage.read_ranges([(str(tmp_path / "short.bin"), a, b) for a, b in spans[1:3]])
