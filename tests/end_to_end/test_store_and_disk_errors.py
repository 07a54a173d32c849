"""Errors a user can act on, from anywhere: a store's or disk's failure on the driver or on a
Ray worker reaches the user as one line naming the input or output and the file, with exit
status 2 (missing, denied, refused credentials) or 1 (a full disk, a store still throttling
after its retries), never a traceback.

Real components: moto's S3 server over HTTP (a missing bucket, a Deny bucket policy, refused
access keys, SlowDown answers), real files deleted or written to /dev/full, a real local Ray.
Steps inside a job are found without sleeping: the server calls a test's hook on the request
that takes the output's lease (every check has passed by then, no pass has started), or on
the first read of an input's data.
The commands run in this process join the shared Ray (`ray_s3`); `_cli` runs the real
command in a process of its own, which joins that Ray too (its workers' output comes to the
command's stderr as it would from an embedded Ray's); the full disk's command, in a mount
namespace of its own, starts its own embedded Ray there.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import s3fs
import shared_ray
from botocore.exceptions import ClientError
from builders import build_model_set, load_checkpoint
from reference import reference_merge
from s3_server import storage_options
from s3fs.errors import translate_boto_error

from ram_dist.cli import main
from ram_dist.errors import RamDistError, StorageError
from ram_dist.io.failures import classify, storage_error, transient
from ram_dist.io.json_files import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, read_json
from ram_dist.io.lease import LEASE_NAME
from ram_dist.io.storage import S3_RETRIES, Storage
from ram_dist.io.writer import PARTIAL_SUFFIX

BUCKET = "worker-errors"
INDEX = "model.safetensors.index.json"
MANIFEST = "ram_dist_manifest.json"


# -- the classifier -----------------------------------------------------------------------


def _client_error(code: str, status: int, message: str = "") -> ClientError:
    response = {
        "Error": {"Code": code, "Message": message or code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "GetObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status", "kind", "exit_status", "words"),
    [
        ("AccessDenied", 403, "denied", 2, "permission denied"),
        ("403", 403, "denied", 2, "permission denied"),  # moto's bare 403 for a Deny policy
        ("NoSuchBucket", 404, "missing", 2, "bucket bkt does not exist"),
        ("NoSuchKey", 404, "missing", 2, "no such file"),
        ("ExpiredToken", 400, "credentials", 2, "the credentials have expired"),
        ("InvalidAccessKeyId", 403, "credentials", 2, "refused the credentials"),
        ("SlowDown", 503, "throttled", 1, "still throttling requests after its retries"),
        ("InternalError", 500, "server", 1, "the store failed after its retries"),
    ],
)
def test_store_errors_are_classified_with_or_without_s3fs(code, status, kind, exit_status, words):
    url = "s3://bkt/in/t1/model.safetensors"
    raw = _client_error(code, status)
    for error in (raw, translate_boto_error(raw)):  # botocore's, and s3fs's builtin OSError
        assert classify(error).kind == kind
        err = storage_error(error, url, "read", "input")
        assert err.exit_status == exit_status
        assert str(err).startswith(f"input {url}: cannot read: ")
        assert words in str(err) and "\n" not in str(err)
    assert transient(raw) == (exit_status == 1)


@pytest.mark.parametrize(
    ("error", "kind", "exit_status"),
    [
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), "missing", 2),
        (PermissionError(errno.EACCES, "Permission denied"), "denied", 2),
        (OSError(errno.EROFS, "Read-only file system"), "denied", 2),
        (OSError(errno.ENOSPC, "No space left on device"), "full", 1),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "full", 1),
        (OSError(errno.EIO, "Input/output error"), "other", 1),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "unreachable", 1),
    ],
)
def test_disk_errors_are_classified_by_errno(error, kind, exit_status):
    assert classify(error).kind == kind
    err = storage_error(error, "/data/out/model.safetensors", "write", "output")
    assert err.exit_status == exit_status
    assert str(err).startswith("output /data/out/model.safetensors: cannot write: ")
    assert errno.errorcode[error.errno] in str(err)


def test_a_storage_error_crosses_ray_with_its_status():
    err = storage_error(OSError(errno.ENOSPC, "No space left on device"), "/o/x", "write")
    again = pickle.loads(pickle.dumps(err))  # as Ray ships a worker's exception
    assert type(again) is StorageError and again.exit_status == 1 and str(again) == str(err)


# -- the jobs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"base": base_dir, "tasks": task_dirs, "expected": expected, "root": root}


def _upload(models: dict, fs: s3fs.S3FileSystem, prefix: str) -> tuple[str, list[str]]:
    """A fresh copy of the inputs under `prefix` of the bucket: (base URL, task URLs)."""
    for d in [models["base"], *models["tasks"]]:
        fs.put(str(d), f"{BUCKET}/{prefix}/{d.name}", recursive=True)
    names = [d.name for d in models["tasks"]]
    return f"s3://{BUCKET}/{prefix}/base", [f"s3://{BUCKET}/{prefix}/{n}" for n in names]


def _local_copy(models: dict, folder: Path) -> tuple[Path, list[Path]]:
    import shutil

    for d in [models["base"], *models["tasks"]]:
        shutil.copytree(d, folder / d.name)
    return folder / "base", [folder / d.name for d in models["tasks"]]


def _argv(base, tasks, out, options: dict | None, *extra: str) -> list[str]:
    argv = ["merge", "--base", str(base), "--out", str(out), *extra]
    for t in tasks:
        argv += ["--task", str(t)]
    if options is not None:
        argv += ["--storage-options", json.dumps(options)]
    return argv


def _cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The real `ram-dist` in a process of its own, on the shared Ray (which logs its
    workers' output for this job to this stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "ram_dist.cli", *argv],
        env=shared_ray.joining_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line(stderr: str, *fragments: str) -> str:
    """The error line, once the whole of stderr is known to be that one line (but for the
    test server's own log, when the command ran in this process)."""
    lines = [s for s in stderr.strip().splitlines() if not s.startswith("127.0.0.1 - - [")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ram-dist: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in stderr and "ray::" not in stderr
    return lines[0]


def _nothing_published(fs: s3fs.S3FileSystem | None, out: str) -> None:
    """No index, and no shard at its final name unless the manifest records it as finished
    (a re-run reuses those); the lease was given back."""
    if fs is not None:
        fs.invalidate_cache()
        names = [p.rsplit("/", 1)[-1] for p in fs.find(out)]
        read = fs.cat_file
    else:
        names = os.listdir(out) if os.path.isdir(out) else []
        read = lambda p: Path(p).read_bytes()  # noqa: E731
    assert INDEX not in names and LEASE_NAME not in names, names
    shards = {n for n in names if n.endswith(".safetensors")}
    finished = json.loads(read(f"{out}/{MANIFEST}"))["shards"] if MANIFEST in names else {}
    assert shards <= set(finished), (shards, sorted(finished))


@contextmanager
def _hook(server, hook: Callable[[dict[str, Any]], Any]) -> Iterator[None]:
    server.intercept = hook
    try:
        yield
    finally:
        server.intercept = None


def _on_lease_put(action: Callable[[], None]) -> Callable[[dict[str, Any]], None]:
    """A hook that runs `action` once, when a job creates its output's lease: after every
    check of the inputs, before the first pass reads anything."""
    done: list[bool] = []

    def hook(environ: dict[str, Any]) -> None:
        put = environ["REQUEST_METHOD"] == "PUT"
        if put and environ.get("PATH_INFO", "").endswith(LEASE_NAME) and not done:
            done.append(True)
            action()

    return hook


def _deny(fs: s3fs.S3FileSystem, prefix: str, action: str = "s3:GetObject") -> None:
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Deny",
                "Principal": "*",
                "Action": action,
                "Resource": f"arn:aws:s3:::{BUCKET}/{prefix}",
            }
        ],
    }
    fs.call_s3("put_bucket_policy", Bucket=BUCKET, Policy=json.dumps(policy))


@contextmanager
def _policy_removed_after(fs: s3fs.S3FileSystem) -> Iterator[None]:
    try:
        yield
    finally:
        fs.call_s3("delete_bucket_policy", Bucket=BUCKET)


@pytest.mark.usefixtures("ray_s3")
def test_missing_input_and_output_buckets(models, options, fs, capsys, caplog):
    base, tasks = _upload(models, fs, "buckets")
    argv = _argv("s3://no-such-inputs/base", tasks, f"s3://{BUCKET}/buckets-out", options)
    caplog.set_level(logging.DEBUG, logger="ram_dist")
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, "base model", "bucket no-such-inputs does not exist")
    failed = [r for r in caplog.records if r.name == "ram_dist.cli"]
    assert failed and failed[0].levelno == logging.DEBUG and failed[0].exc_info  # the traceback
    assert main(_argv(base, tasks, "s3://no-such-outputs/out", options)) == 2
    _one_line(capsys.readouterr().err, "output s3://no-such-outputs/out cannot be written")


@pytest.mark.usefixtures("ray_s3")
def test_a_denied_input_is_named_before_any_work(models, options, fs, server, capsys):
    base, tasks = _upload(models, fs, "denied-first")
    out = f"s3://{BUCKET}/denied-first-out"
    with _policy_removed_after(fs):
        _deny(fs, "denied-first/task1/model-0*")  # the shards, not the index
        server.clear()
        assert main(_argv(base, tasks, out, options)) == 2
    line = _one_line(
        capsys.readouterr().err,
        f"input {tasks[1]}/model-0000",
        "cannot read: permission denied (HTTP 403)",
        "bucket policy",
    )
    denied = [s for s in server.object_gets(f"{BUCKET}/denied-first/task1/")]
    assert denied and len(denied) == len({s.path for s in denied})  # a 403 is not retried
    assert fs.find(out) == [], line  # not even a lease: the headers are read first


@pytest.mark.usefixtures("ray_s3")
def test_inputs_denied_while_the_job_runs(models, options, fs, server, capsys, caplog):
    """A Deny policy put on a task's files once the job holds its lease: the reduce pass's
    workers are refused; the job stops with the file named, nothing published."""
    base, tasks = _upload(models, fs, "denied-later")
    out = f"s3://{BUCKET}/denied-later-out"
    with (
        _policy_removed_after(fs),
        _hook(server, _on_lease_put(lambda: _deny(fs, "denied-later/task2/*"))),
    ):
        caplog.set_level(logging.DEBUG, logger="ram_dist")
        code = main(_argv(base, tasks, out, options, "--input-cache", "off"))
    assert code == 2
    task_failed = [r for r in caplog.records if r.name == "ram_dist.engine.pool"]
    assert any("ray::_run" in r.getMessage() for r in task_failed)  # the worker's traceback
    _one_line(
        capsys.readouterr().err,
        f"input {tasks[2]}/model-0000",
        "cannot read: permission denied",
    )
    _nothing_published(fs, f"{BUCKET}/denied-later-out")


@pytest.mark.usefixtures("ray_s3")
def test_an_input_deleted_while_the_job_runs(models, options, fs, server, tmp_path):
    """Deleted once the job holds its lease (its checks have read every header): a worker
    finds the file gone. The real CLI, so that Ray's own logging of the task is seen too."""
    base, tasks = _upload(models, fs, "deleted")
    victim = f"{BUCKET}/deleted/task0/model-00001-of-00004.safetensors"
    assert fs.exists(victim)
    local_base, local_tasks = _local_copy(models, tmp_path / "local")
    local_victim = local_tasks[1] / "model-00002-of-00004.safetensors"
    assert local_victim.exists()

    with _hook(server, _on_lease_put(lambda: fs.rm(victim))):
        done = _cli(_argv(base, tasks, f"s3://{BUCKET}/deleted-out", options))
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, f"input s3://{victim}: cannot read: no such file", "deleted")
    _nothing_published(fs, f"{BUCKET}/deleted-out")

    # A local input, the output on S3 for the hook: the same, from the local disk.
    with _hook(server, _on_lease_put(local_victim.unlink)):
        done = _cli(_argv(local_base, local_tasks, f"s3://{BUCKET}/deleted-local-out", options))
    assert done.returncode == 2, done.stderr
    _one_line(done.stderr, f"input {local_victim}: cannot read: no such file (ENOENT")
    _nothing_published(fs, f"{BUCKET}/deleted-local-out")


@pytest.mark.usefixtures("ray_s3")
def test_a_failing_output_disk_on_a_worker(models, options, fs, server, tmp_path):
    """Workers write their parts in place; a shard's partial file that turns into /dev/full
    (every write: ENOSPC) once its parts are being made fails the job with status 1 and
    the shard named, and nothing is published: no shard, no index."""
    base, tasks = _upload(models, fs, "full-worker")
    out = tmp_path / "out"
    shard = "model-00001-of-00003.safetensors"
    partial = out / (shard + PARTIAL_SUFFIX)

    def swap() -> None:  # the driver made the partial file; no worker has written it yet
        if partial.is_file() and not partial.is_symlink():
            partial.unlink()
            partial.symlink_to("/dev/full")

    reads: list[bool] = []

    def hook(environ: dict[str, Any]) -> None:
        if environ["REQUEST_METHOD"] == "GET" and partial.exists() and not reads:
            reads.append(True)
            swap()

    with _hook(server, hook):
        done = _cli(_argv(base, tasks, out, options, "--input-cache", "off"))
    assert reads, "the map pass never read while the shard was open"
    assert done.returncode == 1, done.stderr
    _one_line(
        done.stderr, f"output {out / shard}: cannot write: no space left on the device (ENOSPC"
    )
    _nothing_published(None, str(out))
    assert not partial.is_symlink() and not (out / shard).exists()  # the partial was removed

    # A re-run on a working disk resumes and gives the exact merge.
    done = _cli(_argv(base, tasks, out, options, "--input-cache", "off"))
    assert done.returncode == 0, done.stderr
    merged = load_checkpoint(out)
    assert all((merged[k] == v).all() for k, v in models["expected"].items())


@pytest.mark.usefixtures("ray_s3")
def test_a_failing_output_disk_on_the_driver(models, tmp_path, capsys):
    """The manifest, written by the driver after the reduce pass, lands on /dev/full."""
    base, tasks = _local_copy(models, tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    (out / (MANIFEST + PARTIAL_SUFFIX)).symlink_to("/dev/full")
    # --overwrite: the folder holds a file (the planted link), which the merge writes over
    code = _cli(_argv(base, tasks, out, None, "--overwrite"))
    assert code.returncode == 1, code.stderr
    _one_line(code.stderr, f"output {out / MANIFEST}: cannot write: no space left on the device")
    _nothing_published(None, str(out))
    assert not (out / MANIFEST).exists()


@pytest.mark.usefixtures("ray_s3")
def test_slowdown_is_retried_by_botocore_then_named(models, options, fs, server):
    """Throttling is transient: botocore retries it (then s3fs once more per request), and a
    store that keeps answering SlowDown fails the job with status 1 naming the file. A store
    that stops throttling in time gives the exact merge."""
    base, tasks = _upload(models, fs, "slow")
    victim = "/" + f"{BUCKET}/slow/task1/model-00003-of-00004.safetensors"
    few = dict(options["s3"], config_kwargs={"retries": {"mode": "standard",
                                                         "total_max_attempts": 2}})  # fmt: skip

    def slow_down(environ: dict[str, Any]) -> tuple[int, str] | None:
        ranged = environ.get("HTTP_RANGE") or ""
        if environ.get("PATH_INFO") == victim and not ranged.startswith("bytes=0-"):
            return 503, "SlowDown"
        return None

    server.clear()
    with _hook(server, slow_down):
        done = _cli(_argv(base, tasks, f"s3://{BUCKET}/slow-out", {"s3": few}, "--workers", "1"))
    assert done.returncode == 1, done.stderr
    _one_line(
        done.stderr,
        f"input s3:/{victim}: cannot read: the store is still throttling requests after its "
        "retries (SlowDown",
    )
    data_reads = [s for s in server.log if s.path == victim and s.range]
    data_reads = [s for s in data_reads if not s.range.startswith("bytes=0-")]
    tries = [s for s in data_reads if s.range == data_reads[0].range]
    assert len(tries) == 2 * 5  # botocore's 2 attempts, each of the 5 times s3fs asks

    # Three SlowDown answers, then the bytes: the default retry mode rides it out.
    assert S3_RETRIES["total_max_attempts"] > 3
    left = [3]

    def three(environ: dict[str, Any]) -> tuple[int, str] | None:
        if slow_down(environ) is not None and left[0] > 0:
            left[0] -= 1
            return 503, "SlowDown"
        return None

    out = f"s3://{BUCKET}/slow-ok"
    with _hook(server, three):
        done = _cli(_argv(base, tasks, out, options))
    assert done.returncode == 0, done.stderr
    assert left == [0]
    fetched = Path(models["root"]) / "slow-ok"
    fs.get(f"{BUCKET}/slow-ok", str(fetched), recursive=True)
    merged = load_checkpoint(fetched)
    assert all((merged[k] == v).all() for k, v in models["expected"].items())


@pytest.mark.usefixtures("ray_s3")
def test_refused_credentials(models, options, fs, capsys):
    """The store checks access keys (moto's IAM authentication, switched on for this test):
    the test's key is unknown to it."""
    from moto.core.authorization import enable_iam_authentication

    base, tasks = _upload(models, fs, "creds")
    with enable_iam_authentication():
        assert main(_argv(base, tasks, f"s3://{BUCKET}/creds-out", options)) == 2
    _one_line(
        capsys.readouterr().err,
        f"base model: input {base}: cannot list: the store refused the credentials "
        "(InvalidAccessKeyId",
    )


# -- JSON files over their caps -----------------------------------------------------------


def _sparse(path: Path, size: int) -> None:
    """A file of `size` bytes that is no JSON at all (so reading it would say so)."""
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.usefixtures("ray_s3")
def test_an_oversized_index_or_manifest_is_refused_before_it_is_read(models, tmp_path, capsys):
    base, tasks = _local_copy(models, tmp_path / "in")
    _sparse(tasks[0] / INDEX, MAX_INDEX_BYTES + 1)
    out = tmp_path / "out"
    assert main(_argv(base, tasks, out, None)) == 2
    _one_line(
        capsys.readouterr().err,
        f"task 1: input {tasks[0] / INDEX}: {MAX_INDEX_BYTES + 1} bytes, over the "
        f"{MAX_INDEX_BYTES}-byte cap for this index",
    )
    assert not out.exists()

    _, tasks = _local_copy(models, tmp_path / "in2")
    out.mkdir()
    _sparse(out / MANIFEST, MAX_MANIFEST_BYTES + 1)
    assert main(_argv(base, tasks, out, None)) == 2
    cap = (
        f"{MAX_MANIFEST_BYTES + 1} bytes, over the {MAX_MANIFEST_BYTES}-byte cap for this manifest"
    )
    _one_line(capsys.readouterr().err, f"output {out / MANIFEST}: {cap}")
    assert main(["verify", str(out)]) == 2
    _one_line(capsys.readouterr().err, f"output {out / MANIFEST}: {cap}")
    assert os.listdir(out) == [MANIFEST]


def test_json_over_its_cap_is_refused_from_its_size_alone(fs, server, tmp_path):
    """On S3: the store's answer to HEAD decides, no GET is sent; within the cap, one GET."""
    fs.pipe(f"{BUCKET}/json/big.json", b'{"x": "' + b"y" * 100 + b'"}')
    url = f"s3://{BUCKET}/json/big.json"
    storage = Storage(storage_options(server))
    server.clear()
    with pytest.raises(RamDistError, match=r"over the 50-byte cap for this report"):
        read_json(url, storage, 50, "report", "output")
    assert [s.method for s in server.log if s.path.endswith("big.json")] == ["HEAD"]
    server.clear()
    assert read_json(url, storage, 200, "report", "output") == {"x": "y" * 100}
    assert [s.method for s in server.log if s.path.endswith("big.json")] == ["HEAD", "GET"]
    with pytest.raises(FileNotFoundError):
        read_json(f"s3://{BUCKET}/json/none.json", storage, 50, "report", "output")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RamDistError, match="nested too deeply|not valid JSON"):
        read_json(str(deep), Storage(), 10**6, "manifest", "output")


def _can_mount_tmpfs() -> bool:
    """Whether this machine lets a process mount a tmpfs in a user namespace of its own."""
    try:
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no tmpfs mount in a user namespace here")
def test_a_full_output_disk(models, tmp_path):
    """A real full disk: the output on a 128 KiB tmpfs (the merged shards take 216 KB),
    mounted in a user namespace of the command's own. Whichever write finds the disk full
    (a worker's part, the driver's manifest) ends the job with status 1 naming that file;
    the lease is given back, and no index is written."""
    base, tasks = _local_copy(models, tmp_path / "in")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "out"
    command = [sys.executable, "-m", "ram_dist.cli", *_argv(base, tasks, out, None)]
    script = (
        f'mount -t tmpfs -o size=128k tmpfs "{disk}" && '
        f'{" ".join(map(shlex.quote, command))}; echo "status $?"; ls -A "{out}"'
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "status " in done.stdout, done.stdout + done.stderr
    status, *left = done.stdout.split("status ", 1)[1].splitlines()  # then what `ls` found
    assert status == "1", done.stdout + done.stderr
    # A job slower than the lease's renewal period (kernels compiled in a cold cache) also
    # finds the disk full when it renews the lease: that warning is true, and names it too.
    renewals = [s for s in done.stderr.splitlines() if "could not renew the lease" in s]
    assert all("no space" in s.lower() or "ENOSPC" in s for s in renewals), done.stderr
    stderr = "\n".join(s for s in done.stderr.splitlines() if s not in renewals)
    line = _one_line(stderr, f"output {out}/", ": cannot write: no space left on the device")
    assert "(ENOSPC" in line
    assert INDEX not in left and LEASE_NAME not in left and LEASE_NAME + ".guard" not in left
