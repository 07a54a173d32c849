"""A sweep into a GCS bucket (the emulator of `gcs_server` over HTTP, Ray workers): every
variant's parts uploaded by the workers and composed, the local sweep's bytes, each verified
where it lies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gcs_server import GcsServer, bucket_fs, running_gcs_server, storage_options
from remote_sweeps import NAMES, check_remote_sweep

BUCKET = "ram-dist-sweep"


@pytest.fixture(scope="module")
def server() -> Iterator[GcsServer]:
    with running_gcs_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def ray_gcs(server, own_ray) -> Iterator[None]:
    """A real local Ray started inside the server's environment (its workers inherit it)."""
    from conftest import local_ray

    with local_ray():
        yield


@pytest.mark.usefixtures("ray_gcs")
def test_a_sweep_into_a_gcs_bucket_is_the_local_sweep(tmp_path):
    options = storage_options()
    fs = bucket_fs(options, BUCKET)
    report = check_remote_sweep(tmp_path, f"gs://{BUCKET}/sweep", options, fs, f"{BUCKET}/sweep")
    assert [v["name"] for v in report["variants"]] == NAMES
