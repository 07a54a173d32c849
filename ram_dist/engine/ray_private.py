"""Every use ram-dist makes of Ray's private API (`ray._private`), in one place: Ray has no
public call for these. Each answers with a harmless fallback when a Ray release changes what
it reads; tests/engine/test_ray_private.py checks each against the Ray installed, and
pyproject.toml pins `ray` to the releases tested.

- the running task's attempt number (`UnitResult.attempt`);
- the processes of the Ray this process started, and forgetting them, so that an embedded
  Ray is stopped at once rather than one process after another (`runtime.stop_embedded`);
- the logger of Ray's notice that token authentication is on (`runtime`'s filter);
- a worker's serialization context, built as the worker starts (`worker_preload`).
"""

from __future__ import annotations

from typing import Any

import ray

#: The logger Ray prints "Token authentication is enabled" with, on every start.
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def task_attempt() -> int:
    """The running Ray task's attempt number (0 for the first; 0 as well outside a task, or
    when the private call is gone or fails: it must never fail a task)."""
    core = getattr(_worker_module().global_worker, "core_worker", None)
    get = getattr(core, "get_current_task_attempt_number", None)
    try:
        return int(get()) if get is not None else 0
    except Exception:  # noqa: BLE001  (a private call: never let it fail a task)
        return 0


def serialization_ready() -> bool:
    """Build this process's serialization context now, which Ray otherwise builds on the
    first task's arguments (importing pydantic among others: about 0.2 s of CPU), and say
    whether it exists (False when the private call is gone or fails: never fatal)."""
    get = getattr(_worker_module().global_worker, "get_serialization_context", None)
    try:
        return get is not None and get() is not None
    except Exception:  # noqa: BLE001  (a private call: never let it fail a worker's start)
        return False


def node_processes() -> dict[str, list[Any]] | None:
    """The processes of the Ray node this process started (`ray.init` without an address),
    by kind ("raylet", "gcs_server", ...), each with its `subprocess.Popen` as `.process`;
    None when it started none, or when Ray no longer keeps them where this reads."""
    node = getattr(_worker_module(), "_global_node", None)
    processes = getattr(node, "all_processes", None)
    return processes if isinstance(processes, dict) else None


def forget_node() -> None:
    """Make this process forget the Ray node it started, so that `ray.shutdown()` only
    disconnects and leaves its processes to the caller (`runtime.stop_embedded`)."""
    _worker_module()._global_node = None


def _worker_module() -> Any:
    return ray._private.worker
