"""Azure's errors as a user reads them: the SDK's own exceptions (azure-core's, raised as
azure-storage-blob raises them, with Azure's error code) classified and explained in one
line; and the block ids of a shard's blob."""

from __future__ import annotations

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
)

from ram_dist.io.azure import block_id
from ram_dist.io.failures import classify, storage_error

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _error(cls: type[HttpResponseError], code: str, message: str) -> HttpResponseError:
    e = cls(message=f"{message}\nRequestId:0\nTime:2026-11-27T00:00:00Z\nErrorCode:{code}")
    e.error_code = code  # as azure-storage-blob's `process_storage_error` sets it
    return e


@pytest.mark.parametrize(
    ("error", "kind", "status", "words"),
    [
        (_error(ResourceNotFoundError, "ContainerNotFound", "The specified container does not "
                "exist."), "missing", 2, "container box does not exist (ContainerNotFound: "),
        (_error(ResourceNotFoundError, "BlobNotFound", "The specified blob does not exist."),
         "missing", 2, "no such file (BlobNotFound: The specified blob does not exist.)"),
        (_error(ClientAuthenticationError, "AuthenticationFailed", "Server failed to "
                "authenticate the request."), "credentials", 2, "refused the credentials"),
        (_error(HttpResponseError, "AuthorizationPermissionMismatch", "This request is not "
                "authorized to perform this operation using this permission."), "denied", 2,
         "permission denied (AuthorizationPermissionMismatch"),
        (_error(HttpResponseError, "ServerBusy", "Operations per second is over the account "
                "limit."), "throttled", 1, "still throttling requests after its retries"),
        (ServiceRequestError("Cannot connect to host"), "unreachable", 1, "could not be reached"),
        (ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token"),
         "credentials", 2, "refused the credentials"),
    ],
)  # fmt: skip
def test_azure_errors_are_classified_and_explained(error, kind, status, words) -> None:
    wrapped = FileNotFoundError(2, "No such file or directory")  # as adlfs raises a missing blob
    wrapped.__cause__ = error
    for e in (error, wrapped) if kind == "missing" else (error,):
        assert classify(e).kind == kind
        message = str(storage_error(e, "az://box/in/base/model.safetensors", "read", "input"))
        assert "\n" not in message and words in message, message
        assert storage_error(e, "az://box/x", "read").exit_status == status


def test_block_ids_have_one_width_and_sort_in_part_order() -> None:
    ids = [block_id("0123456789abcdef", n) for n in (1, 2, 10, 9999)]
    assert len({len(i) for i in ids}) == 1 and ids == sorted(ids)
    assert block_id("0123456789abcdef", 1) != block_id("fedcba9876543210", 1)
