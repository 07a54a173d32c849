"""Kill a `ram-dist merge` once its manifest records a finished part of a shard still being
written: the one step every store's resume-inside-a-shard test shares; and once a first
shard is finished (`kill_after_first_shard`, the local and S3 resume tests); and a sweep
once its variants are inside a shard (`kill_sweep_mid_shard`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ram_dist.io.names import PARTIAL_SUFFIX


def recorded_parts(cat: Callable[[], bytes]) -> dict[str, Any] | None:
    """The manifest `cat` reads, once it records a part of a shard being written."""
    try:
        manifest = json.loads(cat())
    except (FileNotFoundError, ValueError):
        return None
    return manifest if any(w["parts"] for w in manifest["writing"].values()) else None


def kill_once_recorded(
    args: list[str], env: dict[str, str], cat: Callable[[], bytes]
) -> dict[str, Any]:
    """Run `args` in a session of its own and SIGKILL the whole session (driver and
    workers) once `recorded_parts(cat)` is a manifest; return that manifest."""
    proc = subprocess.Popen(args, env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while (manifest := recorded_parts(cat)) is None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no part was ever recorded"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return manifest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def env_without_ray(**extra: str) -> dict[str, str]:
    """This process's environment without `RAY_ADDRESS` (a `ram-dist` command starts its own
    Ray), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(extra)
    return env


def manifest_or_none(read_text) -> dict | None:
    """The manifest `read_text()` gives, or None where it is missing or half written."""
    try:
        return json.loads(read_text())
    except (FileNotFoundError, ValueError):
        return None


def kill_after_first_shard(
    args: list[str], env: dict, read_manifest, mid_shard: bool = False, out: Path | None = None
) -> dict:
    """Run the CLI, SIGKILL its whole process group once one shard (not all) is finished
    and, with `mid_shard`, the manifest records finished parts of a shard being written.
    The manifest is saved at most every 2 s, so a fast map pass can finish between two
    looks: then, given the local `out`, the run is tried again from an empty output. So it
    is when, given `out` and `mid_shard`, the driver published a shard it had recorded parts
    of between the look and the kill (its partial file is gone: nothing left to resume in)."""
    for _ in range(2 if out is None else 4):
        manifest = _try_to_kill(args, env, read_manifest, mid_shard)
        if manifest is not None and (out is None or not mid_shard or _partial_kept(out, manifest)):
            return manifest
        if out is not None:
            shutil.rmtree(out)
    pytest.fail("the merge ended before it could be killed, every time")


def _partial_kept(out: Path, manifest: dict) -> bool:
    """Every shard the manifest records parts of is still a partial file in `out`."""
    writing = [name for name, w in manifest.get("writing", {}).items() if w["parts"]]
    return all((out / f"{name}{PARTIAL_SUFFIX}").exists() for name in writing)


def _try_to_kill(args: list[str], env: dict, read_manifest, mid_shard: bool) -> dict | None:
    def ready() -> dict | None:
        manifest = read_manifest()
        if not manifest or not 1 <= len(manifest["shards"]) < len(manifest["shard_names"]):
            return None
        inside = not mid_shard or any(w["parts"] for w in manifest.get("writing", {}).values())
        return manifest if inside else None

    return _kill_when(args, env, ready, "the map pass never finished a first shard")


def _kill_when(args: list[str], env: dict, ready: Callable[[], Any], never: str) -> Any:
    """Run the CLI with `args` in a session of its own and SIGKILL the whole session once
    `ready()` is truthy: return what it gave, or None where the run ended first."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ram_dist.cli", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if got := ready():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return got
            if proc.poll() is not None:
                assert proc.returncode == 0, proc.stderr.read()
                return None
            time.sleep(0.01)
        pytest.fail(never)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kill_sweep_mid_shard(args: list[str], env: dict, out: Path, watch: list[str]) -> None:
    """Run a `ram-dist merge` sweep into `out` and SIGKILL its whole process group once the
    manifest of every variant in `watch` records a finished shard (not all) and finished
    parts of a shard still being written (its partial file there). A map pass that ends
    between two looks is run again from an empty `out`."""
    for _ in range(4):
        if _try_to_kill_sweep(args, env, out, watch):
            return
        shutil.rmtree(out)
    pytest.fail("the sweep ended before it could be killed, every time")


def _mid_shard(folder: Path) -> bool:
    manifest = manifest_or_none((folder / "ram_dist_manifest.json").read_text)
    if not manifest or not 1 <= len(manifest["shards"]) < len(manifest["shard_names"]):
        return False
    return any(w["parts"] for w in manifest["writing"].values()) and _partial_kept(folder, manifest)


def _try_to_kill_sweep(args: list[str], env: dict, out: Path, watch: list[str]) -> bool:
    ready = lambda: all(_mid_shard(out / name) for name in watch)  # noqa: E731
    return bool(_kill_when(args, env, ready, "the sweep's map pass never finished a first shard"))
