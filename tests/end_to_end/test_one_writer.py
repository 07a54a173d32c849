"""One writer per output, tried as a user would: two merges started a second apart into the
same output, locally and on the S3 server (`ram-dist` processes of their own, which join the
shared Ray: the race is for the output's lease, not for a Ray); a lease left by another host,
fresh or stale, with or without files beside it, and another run's write check (the CLI's
entry point in this process, on the shared Ray).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import shared_ray
from builders import build_model_set
from s3_server import CountingMotoServer, bucket_fs, running_server, storage_options

from ram_dist.cli import main
from ram_dist.io.lease import LEASE_NAME, Holder
from ram_dist.io.names import INDEX_NAME, MANIFEST_NAME, WRITE_CHECK_PREFIX

BUCKET = "one-writer"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, _, _ = build_model_set(root, base_shard="100KB", task_shard=70_000)
    return {"base": base_dir, "tasks": task_dirs, "root": root}


@pytest.fixture(scope="module")
def server() -> Iterator[CountingMotoServer]:
    with running_server() as srv:
        yield srv


def _args(models: dict, out: str, r: str, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "ram_dist.cli", "merge", "--base", str(models["base"]),
            "--out", out, "--r", r, "--unit-mb", str(1024 / 2**20), *extra]  # fmt: skip
    for t in models["tasks"]:
        args += ["--task", str(t)]
    return args


def _in_process(args: list[str]) -> int:
    """`_args`'s command line run by the CLI's entry point in this process."""
    return main(args[3:])


def _race(first: list[str], second: list[str]) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Start `first`, then `second` a second later, both on the shared Ray; wait for both."""
    env = shared_ray.joining_env()
    kw = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    a = subprocess.Popen(first, **kw)
    time.sleep(1.0)
    b = subprocess.Popen(second, **kw)
    for p in (a, b):
        p.wait(timeout=300)
    return a, b


def _outcome(a, b, r_a: str, r_b: str) -> tuple[str, str]:
    """(the winner's r, the loser's stderr): exactly one wrote, the other exited 2."""
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 2], (a.stderr.read(), b.stderr.read())
    winner, loser = (a, b) if a.returncode == 0 else (b, a)
    return (r_a if winner is a else r_b), loser.stderr.read()


def test_two_merges_into_one_local_output(models, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    a, b = _race(_args(models, out, "0.1"), _args(models, out, "0.3"))
    r, err = _outcome(a, b, "0.1", "0.3")
    assert "is held by another ram-dist merge: job ram-dist merge" in err
    assert f"on host {socket.gethostname()}" in err and "--overwrite does not" in err
    assert err.count("\n") == 1  # one line, no traceback
    clean = str(tmp_path / "clean")
    assert _in_process(_args(models, clean, r)) == 0, capsys.readouterr().err
    names = sorted(os.listdir(clean))
    assert sorted(os.listdir(out)) == names  # no lease left behind, nothing of the loser
    for name in names:
        if name.endswith((".safetensors", ".json")) and name != "merge_report.json":
            if name == "ram_dist_manifest.json":
                continue  # names the output folder
            assert (
                open(os.path.join(out, name), "rb").read()
                == open(os.path.join(clean, name), "rb").read()
            ), name
    manifest = json.load(open(os.path.join(out, "ram_dist_manifest.json")))
    assert manifest["identity"]["parameters"]["r"] == float(r)


def test_two_merges_into_one_s3_output(models, server, tmp_path, ray_local, capsys):
    options = storage_options(server)
    fs = bucket_fs(options, BUCKET)
    extra = ("--storage-options", json.dumps(options))
    out = f"s3://{BUCKET}/out"
    a, b = _race(_args(models, out, "0.1", *extra), _args(models, out, "0.3", *extra))
    r, err = _outcome(a, b, "0.1", "0.3")
    assert f"s3://{BUCKET}/out/{LEASE_NAME}: the output location is held by" in err
    clean = tmp_path / "clean"
    assert _in_process(_args(models, str(clean), r)) == 0, capsys.readouterr().err
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/out", refresh=True))
    assert listed == sorted(os.listdir(clean))  # the lease was released
    for name in listed:
        if name.endswith(".safetensors"):
            assert fs.cat_file(f"{BUCKET}/out/{name}") == (clean / name).read_bytes(), name


def _lease_from_another_host(out, renewed_ago_s: float) -> None:
    os.makedirs(out, exist_ok=True)
    now = time.time()
    holder = Holder("ram-dist merge elsewhere", "other-host", 4242, now - 900, now - renewed_ago_s)
    with open(os.path.join(out, LEASE_NAME), "w") as f:
        f.write(holder.to_json())


def test_a_live_lease_of_another_host_refuses_even_with_overwrite(
    models, tmp_path, ray_local, capsys
):
    out = str(tmp_path / "out")
    _lease_from_another_host(out, renewed_ago_s=5)
    assert _in_process(_args(models, out, "0.1", "--overwrite")) == 2
    assert "job ram-dist merge elsewhere on host other-host (pid 4242)" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == [LEASE_NAME]  # nothing written


def test_files_beside_a_live_lease_are_that_run_s_and_the_refusal_names_it(
    models, tmp_path, ray_local, capsys
):
    """A run that finds another's shards (no manifest yet) or another merge's manifest while
    that run holds the lease says who is writing, not what the files are."""
    out = str(tmp_path / "out")
    _lease_from_another_host(out, renewed_ago_s=5)
    shard = os.path.join(out, "model-00001-of-00002.safetensors")
    with open(shard, "wb") as f:
        f.write(b"being written")
    assert _in_process(_args(models, out, "0.1")) == 2
    err = capsys.readouterr().err
    assert "held by another ram-dist merge: job ram-dist merge elsewhere" in err, err
    assert "already holds files" not in err
    assert _in_process(_args(models, str(tmp_path / "done"), "0.3")) == 0
    shutil.copy(os.path.join(tmp_path, "done", MANIFEST_NAME), os.path.join(out, MANIFEST_NAME))
    capsys.readouterr()
    assert _in_process(_args(models, out, "0.1")) == 2
    err = capsys.readouterr().err
    assert "held by another ram-dist merge" in err and "changed:" not in err, err
    os.remove(os.path.join(out, LEASE_NAME))  # no run holds it: the files speak for themselves
    assert _in_process(_args(models, out, "0.1")) == 2
    assert "holds a merge of other inputs or parameters; changed: " in capsys.readouterr().err


def test_another_run_s_write_check_is_no_output_file(models, tmp_path, ray_local, capsys):
    """The empty file a starting run writes and removes to learn that it may write is not
    taken for a model by a run that lists the folder meanwhile."""
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{WRITE_CHECK_PREFIX}-0123456789ab").write_bytes(b"")
    assert _in_process(_args(models, str(out), "0.1")) == 0, capsys.readouterr().err
    assert (out / INDEX_NAME).exists()


def test_a_stale_lease_of_another_host_is_taken_over_and_said(models, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    _lease_from_another_host(out, renewed_ago_s=1000)
    assert _in_process(_args(models, out, "0.1")) == 0
    said = capsys.readouterr().out
    assert "took over the lease of job ram-dist merge elsewhere on host other-host" in said
    assert "not renewed for" in said
    assert LEASE_NAME not in os.listdir(out)
    report = json.load(open(os.path.join(out, "merge_report.json")))
    assert "not renewed for" in report["output"]["lease"]["took_over"]
