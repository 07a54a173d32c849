"""Ray's private API behind `engine.ray_private`, checked against the Ray installed, on a real
local Ray that this module starts and, at its end, stops as `ram-dist` stops an embedded Ray
(`runtime.stop_embedded`: the raylet and the rest are ended by the node's processes the
adapter finds). pyproject.toml pins `ray` to the releases this passes on."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator

import psutil
import pytest
import ray

from ram_dist.engine import ray_private


@pytest.fixture(scope="module")
def embedded(own_ray) -> Iterator[list[int]]:
    """A local Ray of two CPUs started here; the pids of its node's processes. Stopped
    afterwards by `stop_embedded`, which must leave none of them running."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    processes = ray_private.node_processes()
    pids = [p.process.pid for ps in (processes or {}).values() for p in ps]
    try:
        yield pids
    finally:
        from ram_dist.engine.runtime import stop_embedded

        stop_embedded()
        assert not ray.is_initialized()
        left = [pid for pid in pids if psutil.pid_exists(pid) and not _zombie(pid)]
        assert left == [], "stop_embedded left Ray's processes running"


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_node_this_process_started_is_found_with_its_processes(embedded):
    processes = ray_private.node_processes()
    assert processes is not None
    assert processes.get("raylet"), sorted(processes)
    assert embedded and all(psutil.pid_exists(pid) for pid in embedded)
    for ps in processes.values():
        for p in ps:
            assert p.process.poll() is None  # a running subprocess.Popen


def test_a_tasks_attempt_counts_its_retries(embedded, tmp_path):
    """0 for a task's first run, 1 for its run after its worker died (`ran_by`), 0 on the
    driver."""
    from ram_dist.engine.worker import ran_by

    marker = str(tmp_path / "died once")

    @ray.remote(num_cpus=1, max_retries=1)
    def attempt(die_first: bool) -> int:
        if die_first and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker dies: Ray runs the task again
        return ran_by()["attempt"]

    assert ray.get(attempt.remote(False)) == 0
    assert ray.get(attempt.remote(True)) == 1
    assert ray_private.task_attempt() == 0
    assert ran_by()["attempt"] == 0


def test_the_token_notice_comes_from_the_logger_the_filter_is_on():
    module = importlib.import_module(ray_private.TOKEN_NOTICE_LOGGER)
    assert module.logger is logging.getLogger(ray_private.TOKEN_NOTICE_LOGGER)


def test_a_workers_serialization_context_is_built_on_demand(embedded):
    @ray.remote(num_cpus=1)
    def ready() -> bool:
        return ray_private.serialization_ready()

    assert ray.get(ready.remote())
    assert ray_private.serialization_ready()
