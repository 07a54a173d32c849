"""Shared fixtures: one real local two-CPU Ray per pytest process, shared by the modules that
ask for it (`ray_local`, `ray_s3`; `support/shared_ray.py`), and shut down for a module that
starts its own (`own_ray`); moto's S3 server over HTTP per module, with the module's `BUCKET`
created (a module may define its own `server`)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest

# The test helpers (builders, reference, the servers) live in tests/support.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

import shared_ray  # noqa: E402  (first: it records the session's environment)


@contextlib.contextmanager
def local_ray(num_cpus: int = 2, num_gpus: int | None = None) -> Iterator[None]:
    """A real local Ray of the module's own, of `num_cpus` CPUs (and `num_gpus` GPUs, fake ones
    where the machine has none), shut down after the block; the shared Ray is shut down
    first. The module's fixture that enters it also asks for `own_ray`, which says so to
    the collection's order (`pytest_collection_modifyitems`)."""
    import ray

    shared_ray.suspend()
    ray.init(
        address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
        log_to_driver=False,
    )  # fmt: skip
    try:
        yield
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that shut the shared Ray down (`own_ray`) first, in their order, then the
    rest: pytest-xdist hands out whole files in this order, so each process starts the
    shared Ray once after them rather than again after each (seconds a start)."""
    files = {item.nodeid.split("::")[0] for item in items if "own_ray" in item.fixturenames}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in files)


@pytest.fixture(scope="session")
def _shared_ray_session() -> Iterator[None]:
    """Shuts the shared Ray down when the session ends."""
    yield
    shared_ray.suspend()


@pytest.fixture(scope="module")
def ray_local(_shared_ray_session) -> None:
    """This process's shared real two-CPU Ray (started unless it runs), left running for the
    next module: a module's Ray-wide leftovers must not change another's results."""
    shared_ray.start()


@pytest.fixture(scope="module")
def own_ray() -> None:
    """For a module that starts its own Ray (and stops it when it ends) or needs a process
    with no Ray: the shared Ray is shut down first (the next module that asks starts it)."""
    shared_ray.suspend()


@pytest.fixture(scope="module")
def server():
    """moto's S3 server on 127.0.0.1 for this module (test credentials in the environment)."""
    from s3_server import running_server

    with running_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def options(server) -> dict:
    """ram-dist's storage options for this module's server."""
    from s3_server import storage_options

    return storage_options(server)


@pytest.fixture(scope="module")
def fs(options, request):
    """A client of this module's server, with the module's `BUCKET` created."""
    from s3_server import bucket_fs

    return bucket_fs(options, request.module.BUCKET)


@pytest.fixture(scope="module")
def ray_s3(server, ray_local) -> None:
    """The module's server and the shared Ray, whose workers hold the test credentials
    whenever it started (`shared_ray`); jobs name the server in their storage `options`."""


@pytest.fixture(scope="module")
def big(tmp_path_factory, fs, request) -> dict:
    """`big_model.build_big_set`, also uploaded to the module's bucket (`s3` urls)."""
    from big_model import build_big_set

    bucket = request.module.BUCKET
    models = build_big_set(tmp_path_factory.mktemp("big"))
    for d in [models["base"], *models["tasks"]]:
        fs.put(str(d), f"{bucket}/in/{d.name}", recursive=True)
    models["s3"] = (
        f"s3://{bucket}/in/base",
        [f"s3://{bucket}/in/{d.name}" for d in models["tasks"]],
    )
    return models
