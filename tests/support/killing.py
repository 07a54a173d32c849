"""Kill a `ram-dist merge` once its manifest records a finished part of a shard still being
written: the one step every store's resume-inside-a-shard test shares."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any


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
