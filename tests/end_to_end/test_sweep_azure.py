"""A sweep into an Azure container (Azurite behind `azurite_server`'s proxy, Ray workers):
every variant's blocks staged by the workers and committed, the local sweep's bytes, each
verified where it lies. Skipped without Azurite (failed under CI), as the other Azure tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from azurite_server import AzuriteServer, container_fs, running_azurite, storage_options
from remote_sweeps import NAMES, check_remote_sweep

CONTAINER = "ram-dist-sweep"


@pytest.fixture(scope="module")
def server() -> Iterator[AzuriteServer]:
    with running_azurite() as srv:
        yield srv


@pytest.fixture(scope="module")
def ray_azure(server, own_ray) -> Iterator[None]:
    """A real local Ray started after the server (its workers inherit the connection
    string)."""
    from conftest import local_ray

    with local_ray():
        yield


@pytest.mark.usefixtures("ray_azure")
def test_a_sweep_into_an_azure_container_is_the_local_sweep(tmp_path):
    fs = container_fs(CONTAINER)
    out = f"az://{CONTAINER}/sweep"
    report = check_remote_sweep(tmp_path, out, storage_options(), fs, f"{CONTAINER}/sweep")
    assert [v["name"] for v in report["variants"]] == NAMES
