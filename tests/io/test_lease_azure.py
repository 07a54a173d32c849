"""The output lease on Azure Blob, for real (adlfs over HTTP to Azurite): the lease tests
every store runs (`lease_cases`) on an `az://` location, where conditional Put Blob and
Delete Blob (`If-None-Match: *`, `If-Match`) make the claim exclusive."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azurite_server import container_fs, running_azurite, storage_options
from lease_cases import (  # noqa: F401  (every store's tests, run with this module's `loc`)
    Location,
    test_context_manager_releases_on_exception,
    test_dead_process_on_this_host_is_taken_over_at_once,
    test_lost_when_someone_else_replaces_or_removes_the_lease,
    test_other_host_refused_while_fresh_taken_over_when_stale,
    test_racing_acquirers_exactly_one_wins,
    test_racing_takers_of_a_stale_lease_exactly_one_wins,
    test_renew_thread_updates_renewed,
    test_second_acquirer_refused_then_release_and_reacquire,
    test_unreadable_lease_counts_as_an_unknown_holder,
)

from ram_dist.io.lease import LEASE_NAME
from ram_dist.io.lease.azure import AzureStore
from ram_dist.io.lease.output import _store_for
from ram_dist.io.storage import Storage, join

CONTAINER = "leases"


@pytest.fixture(scope="module")
def azurite() -> Iterator[dict[str, Any]]:
    with running_azurite():
        container_fs(CONTAINER)
        yield storage_options()


@pytest.fixture
def loc(azurite: dict[str, Any]) -> Location:
    out = f"az://{CONTAINER}/{uuid.uuid4().hex}/merged"
    storage = Storage(azurite)
    fs, path = storage.fs(join(out, LEASE_NAME))
    return Location("azure", out, storage, fs, path)


def test_the_azure_lease_is_the_conditional_one(loc: Location) -> None:
    assert isinstance(_store_for(loc.url, loc.storage), AzureStore)
