"""Connect to a Ray cluster, or start an embedded one when there is none. Driver side.

Start-up and shutdown are most of a small merge's time, so an embedded Ray is started while
the driver imports its engine and checks its inputs (`ray_session(..., checks)`), a running
one is joined before them, the workers are warmed as soon as Ray is up, while the checks
may still run, and an embedded Ray is stopped by signalling its processes at once rather
than one after another (`stop_embedded`), after the command has said how it ended
(`ray_stopped_last`).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its at-fork hooks: see `ray_session`)
import contextlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import psutil
import ray

from ram_dist.engine import ray_private
from ram_dist.settings import ray_address

T = TypeVar("T")

#: How long the raylet gets to stop its workers and agents before it is killed.
RAYLET_GRACE_S = 3.0
#: An embedded Ray's setting that has each worker process import `engine.worker_preload`
#: (the task modules, the kernels, numba's registries) as it starts, before it takes a task:
#: the workers Ray starts while `ray.init` still runs are ready when it returns.
PRELOADED = {"preload_python_modules": ["ram_dist.engine.worker_preload"]}


@dataclass(frozen=True)
class Cluster:
    """What the driver needs to know of the cluster it runs on."""

    cpus: int
    gpus: int
    embedded: bool
    memory: int = 0
    """Bytes of Ray's `memory` resource over all nodes (what tasks may use)."""


@contextmanager
def ray_session(address: str | None, checks: Callable[[], T]) -> Iterator[tuple[Cluster, T]]:
    """Use the Ray already initialised in this process, else `address` / `RAY_ADDRESS`, else
    start a local Ray for the duration of the job (and stop it afterwards).

    `checks` runs in a thread while an embedded Ray starts (Ray must be started from the
    main thread); its result comes with the cluster, its exception is raised once Ray is
    stopped again. On a running Ray it runs once connected and the workers are starting
    (`_join_running`); in a process already connected, first.

    Every module whose at-fork hooks come in pairs (a lock taken before a fork, released
    after it) is imported before the thread starts (this module's imports): one imported by
    the checks while `ray.init` forks here would have its release run without its acquire,
    and Python print "release unlocked lock" on stderr (`concurrent.futures.thread`, which
    fsspec imports)."""
    if ray.is_initialized():
        checked = checks()
        yield _cluster(embedded=False), checked
        return
    address = ray_address(address)
    if address:
        cluster, checked = _join_running(address, checks)
        try:
            yield cluster, checked
        finally:
            _stop_later_or_now(ray.shutdown)
        return
    result: dict[str, Any] = {}

    def run_checks() -> None:
        try:
            result["value"] = checks()
        except BaseException as e:  # re-raised in the main thread
            result["error"] = e

    thread = threading.Thread(target=run_checks, name="ram-dist-checks", daemon=True)
    thread.start()
    stop = partial(stop_embedded, _ray_processes())
    try:
        try:
            # "local" always starts a new instance, never a `ray start` cluster on disk.
            _init("local", _system_config=PRELOADED)
            # The workers start now (each imports `worker_preload`), while the checks may
            # still run.
            cluster = _cluster(embedded=True)
            warm_workers(cluster.cpus)
        finally:
            thread.join()
        if "error" in result:
            raise result["error"]
        yield cluster, result["value"]
    finally:
        _stop_later_or_now(stop)


def _join_running(address: str, checks: Callable[[], T]) -> tuple[Cluster, T]:
    """Connect to the Ray at `address`, start the job's workers, then run `checks`. A running
    Ray answers in a few hundredths of a second, and the job's workers take a second or more
    to start (each imports Ray, ram-dist and numba): they start first, so that the checks
    overlap them, and so that the checks' imports, which hold the GIL, delay neither the
    connection nor the warm-up tasks' submission (`benchmarks.bench_fixed_cost`)."""
    _init(address)
    try:
        cluster = _cluster(embedded=False)
        warm_workers(cluster.cpus)
        return cluster, checks()
    except BaseException:
        ray.shutdown()
        raise


def _init(address: str, **options: Any) -> None:
    with _quiet_token_notice(), _own_sigterm_handler():
        ray.init(
            address=address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
            **options,
        )


def _stop_later_or_now(stop: Callable[[], None]) -> None:
    """Stop Ray now, or after the command has said how it ended (`ray_stopped_last`)."""
    deferred = _DEFERRED.get()
    if deferred is not None:
        deferred.append(stop)
    else:
        stop()


def _cluster(embedded: bool) -> Cluster:
    res = ray.cluster_resources()
    return Cluster(
        cpus=max(1, int(res.get("CPU", 1))),
        gpus=int(res.get("GPU", 0)),
        embedded=embedded,
        memory=int(res.get("memory", 0)),
    )


@ray.remote(num_cpus=1)
def _warm() -> None:
    # The modules of the passes' tasks (the methods' registry among them), so that the first
    # task finds them loaded.
    from ram_dist.engine import map_step, pool, reduce_step  # noqa: F401
    from ram_dist.engine.worker import warm_up

    warm_up()


def warm_workers(slots: int) -> None:
    """One task per slot that imports what the passes' tasks import and readies the fused
    kernels' compiler, while the driver still checks and plans: Ray keeps the warmed
    processes for the job's tasks. Nothing waits on them; a failure here shows again in the
    real tasks."""
    for _ in range(slots):
        _warm.options(scheduling_strategy="SPREAD").remote()


@contextmanager
def _own_sigterm_handler() -> Iterator[None]:
    """`ray.init` replaces the SIGTERM handler with its own (`sys.exit(15)`); put back one
    the program chose (the CLI's ends the command like Ctrl-C) once Ray is up."""
    main = threading.current_thread() is threading.main_thread()
    chosen = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(chosen):
            signal.signal(signal.SIGTERM, chosen)


class _TokenNotice(logging.Filter):
    """Drops Ray's notice that token authentication is on: true and right for an embedded
    Ray, but printed on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


@contextmanager
def _quiet_token_notice() -> Iterator[None]:
    log = logging.getLogger(ray_private.TOKEN_NOTICE_LOGGER)
    notice = _TokenNotice()
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)


def stop_embedded(earlier: frozenset[tuple[int, float]] = frozenset()) -> None:
    """Stop the Ray this process started, in a fraction of `ray.shutdown()`'s time, which
    terminates its processes one after another and waits up to a second for each (the
    autoscaler monitor ignores SIGTERM and always costs that second). Here: disconnect, let
    the raylet stop its workers and agents (SIGTERM, then SIGKILL after `RAYLET_GRACE_S`),
    then kill the rest at once: an embedded Ray's GCS keeps nothing worth a clean stop.

    Last, any of Ray's processes below this one that were not there before it started
    (`earlier`) is killed: what a start cut short by a signal leaves, which Ray does not
    know of yet, or an agent whose raylet had to be killed; and so is any worker that was
    below it when the stop began and outlived its raylet (a worker still loading its
    preload, no longer below this process once its raylet is gone)."""
    below = _ray_processes()
    processes = ray_private.node_processes()
    try:
        if processes is None:  # not started, or not what this was written for
            ray.shutdown()
            return
        raylets = [p.process for p in processes.get("raylet", [])]
        rest = [p.process for kind, ps in processes.items() if kind != "raylet" for p in ps]
        ray_private.forget_node()  # so that shutdown() only disconnects
        try:
            ray.shutdown()
        finally:
            _end(raylets, graceful=True)
            _end(rest, graceful=False)
    finally:
        _kill_left(earlier, below)


def _ray_processes() -> frozenset[tuple[int, float]]:
    """Ray's processes below this one, by pid and start time."""
    found: set[tuple[int, float]] = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.cmdline())
            if p.name() in ("raylet", "gcs_server") or "ray::" in line or "/ray/" in line:
                found.add((p.pid, p.create_time()))
    return frozenset(found)


def _kill_left(
    earlier: frozenset[tuple[int, float]], below: frozenset[tuple[int, float]] = frozenset()
) -> None:
    """Kill Ray's processes below this one now, and those `below` it when the stop began,
    unless they were there before Ray started (`earlier`); a pid is killed only while its
    start time is the one recorded (never a process that reused it)."""
    left = []
    for pid, started in (_ray_processes() | below) - earlier:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() != started:
                continue
            p.kill()
            left.append(p)
    psutil.wait_procs(left, timeout=5)


def _end(processes: list[subprocess.Popen[Any]], *, graceful: bool) -> None:
    for p in processes:
        with contextlib.suppress(OSError):
            p.terminate() if graceful else p.kill()
    for p in processes:
        try:
            p.wait(timeout=RAYLET_GRACE_S if graceful else 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)


#: The stops `ray_stopped_last` holds back, in this context (None: stop at once).
_DEFERRED: ContextVar[list[Callable[[], None]] | None] = ContextVar(
    "ram_dist_deferred", default=None
)


@contextmanager
def ray_stopped_last() -> Iterator[None]:
    """Within this, a Ray started by `ray_session` is stopped only when the block ends (the
    CLI's whole command), so that the result is out and the exit status decided before
    Ray's processes are torn down."""
    stops: list[Callable[[], None]] = []
    token = _DEFERRED.set(stops)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
        for stop in stops:
            stop()
