"""What a merge does while Ray starts: the driver imports its engine without torch, and the
checks (`driver.prepare`) import torch, in the thread that runs while Ray starts
(`runtime.ray_session`); the workers are asked for as soon as Ray is up, while the checks may
still run. Either, on the way from Ray's start to the first task, costs about a second."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import ray
from builders import build_model_set

from ram_dist.engine import runtime

IMPORTS = """
import sys
from ram_dist import api
from ram_dist.engine import driver, runtime
from ram_dist.planning.config import MergeConfig
print("torch" in sys.modules)
driver.prepare(MergeConfig(base=sys.argv[1], tasks=tuple(sys.argv[2:]), method="ram_plus"))
print("torch" in sys.modules)
"""


def test_the_engine_imports_without_torch_and_the_checks_import_it(tmp_path) -> None:
    base_dir, task_dirs, _, _ = build_model_set(tmp_path, kind="qwen2")
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS, str(base_dir), *map(str, task_dirs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]


def test_the_workers_are_asked_for_while_the_checks_still_run(monkeypatch) -> None:
    if ray.is_initialized():
        pytest.skip("needs a process with no Ray yet: ray_session starts its own")
    asked = threading.Event()
    warm = runtime.warm_workers

    def warm_and_say(slots: int) -> None:
        warm(slots)
        asked.set()

    monkeypatch.setattr(runtime, "warm_workers", warm_and_say)

    def checks() -> bool:  # ends only once the workers were asked for (or after a minute)
        return asked.wait(60)

    with runtime.ray_session(None, checks) as (cluster, asked_first):
        assert cluster.embedded
        assert asked_first
    assert not ray.is_initialized()
