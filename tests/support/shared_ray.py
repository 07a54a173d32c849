"""One real local Ray per pytest process (each xdist worker), shared by every test module that
needs only a plain two-CPU Ray (`ray_local`, `ray_s3` in tests/conftest.py).

Starting and stopping a Ray costs seconds (tens on a loaded machine), so the shared one is
started by the first module that asks for it and left running for the next ones. A module
that starts a Ray of its own (fake GPUs, a multi-node `ray.cluster_utils.Cluster`, a server's
environment in its workers) or needs a process with no Ray (an embedded Ray, Ray's start and
stop) asks for `own_ray`, which shuts the shared one down first (`suspend`); the next module
that asks for the shared one starts it again.

Whichever module starts it, its processes get the same environment: this process's as the
session began, plus moto's test credentials (`s3_server.TEST_CREDENTIALS`, the same for every
server), so a module's jobs on its own moto server find them in the workers (the server's
address comes with the job's storage options, never from the environment), and no module's
environment outlives it in the workers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

#: This process's environment when the session began (conftest imports this module first).
SESSION_ENV = dict(os.environ)
#: The GCS address of the shared Ray while it is up, else None.
_ADDRESS: list[str | None] = [None]


def _shared_is_up() -> bool:
    import ray

    return (
        _ADDRESS[0] is not None
        and ray.is_initialized()
        and ray.get_runtime_context().gcs_address == _ADDRESS[0]
    )


def start() -> None:
    """Have the shared Ray running: start it unless it is."""
    import ray
    from s3_server import TEST_CREDENTIALS

    if _shared_is_up():
        return
    _ADDRESS[0] = None
    if ray.is_initialized():
        raise RuntimeError(
            "a Ray other than the shared one is still up in this process: a module that "
            "starts its own Ray must stop it when it ends"
        )
    with _environment(SESSION_ENV | TEST_CREDENTIALS):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    _ADDRESS[0] = ray.get_runtime_context().gcs_address


def address() -> str:
    """The shared Ray's GCS address, started unless it runs."""
    start()
    assert _ADDRESS[0] is not None
    return _ADDRESS[0]


def joining_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus `extra`, for a `ram-dist` command in a process of
    its own that joins the shared Ray (started unless it runs) rather than starting one."""
    return {**os.environ, **extra, "RAY_ADDRESS": address()}


def suspend() -> None:
    """Shut the shared Ray down, if it is up, so that this process has no Ray."""
    import ray

    if _shared_is_up():
        ray.shutdown()
    _ADDRESS[0] = None


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`os.environ` is `values` for the block; afterwards it is as before, plus what the
    block set (`ray.init` sets a few variables of its own for the driver)."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        added = {k: v for k, v in os.environ.items() if values.get(k) != v}
        os.environ.clear()
        os.environ.update(before | added)
