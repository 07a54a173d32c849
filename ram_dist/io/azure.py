"""Facts about Azure Blob Storage that ram-dist relies on, kept in one place: its error codes
and how to read them off an error, its block limits, how a block is named, and its entry of
the backend table (`BACKEND`). Imports nothing of ram-dist but `backend` (nor the Azure
SDK), so every io module may use it.

adlfs (`az://`, `abfs://`, `abfss://`) talks to the store through azure-storage-blob's
asynchronous client, `fs.service_client`. That client retries what is transient itself
(adlfs passes it no retry settings, so it runs the SDK's default `ExponentialRetry`: three
retries after about 15, 18 and 24 seconds, of timeouts, 408, 429, 500, 502, 503 and 504
answers and broken connections); nothing is retried again here. A failed request raises an
`azure.core.exceptions.HttpResponseError` whose `error_code` is the store's code (adlfs turns
a missing blob into a `FileNotFoundError` caused by it).
"""

from __future__ import annotations

from ram_dist.io.backend import Backend, StoreErrors

#: Azure's limits on a block blob: at most 50,000 committed blocks (the planner keeps S3's
#: 10,000 parts), and uncommitted blocks are discarded a week after the blob's last Put Block
#: or Put Block List, or at once by a Put Block List that does not name them.
MAX_BLOCKS = 50_000
UNCOMMITTED_BLOCKS_KEPT_DAYS = 7

#: Azure error codes, by what they mean here (`backend.KINDS`).
CODES = {
    "missing": frozenset({"ContainerNotFound", "BlobNotFound", "ResourceNotFound",
                          "ContainerBeingDeleted"}),
    "denied": frozenset({"AuthorizationFailure", "AuthorizationPermissionMismatch",
                         "AuthorizationResourceTypeMismatch", "AuthorizationServiceMismatch",
                         "AuthorizationSourceIPMismatch", "AuthorizationProtocolMismatch",
                         "InsufficientAccountPermissions", "AccountIsDisabled",
                         "KeyVaultEncryptionKeyNotFound"}),
    "credentials": frozenset({"AuthenticationFailed", "InvalidAuthenticationInfo",
                              "NoAuthenticationInformation", "ExpiredAuthenticationToken",
                              "InvalidAccessToken"}),
    "throttled": frozenset({"ServerBusy", "TooManyRequests"}),
    "server": frozenset({"InternalError", "OperationTimedOut"}),
}  # fmt: skip


def error_code(e: BaseException) -> tuple[str | None, int | None] | None:
    """The Azure error code and HTTP status an `HttpResponseError` holds, or None when `e`
    is none (recognised by its attributes: this module imports no SDK)."""
    if type(e).__module__.split(".")[0] != "azure" or not hasattr(e, "error_code"):
        return None
    code = getattr(e, "error_code", None)
    code = getattr(code, "value", code)  # the SDK's own codes are a `StorageErrorCode` enum
    status = getattr(e, "status_code", None)
    if code is None and status is None:
        return None
    if code == "AuthorizationFailure" and "failed to authenticate" in error_message(e):
        code = "AuthenticationFailed"  # Azurite's answer to a wrong key; Azure's own code
    return (str(code) if code else None), (status if isinstance(status, int) else None)


def error_message(e: BaseException) -> str:
    """The first line of an Azure error's message (the rest repeats its code and ids)."""
    text = str(getattr(e, "message", None) or getattr(e, "reason", None) or "")
    return text.strip().splitlines()[0] if text.strip() else ""


def client_failure(e: BaseException) -> str | None:
    """What an Azure error without a response means: "credentials" (none it could get, as
    `DefaultAzureCredential` finding none), "unreachable" (no connection, a timeout), or None."""
    if type(e).__module__.split(".")[0] != "azure":
        return None
    names = {c.__name__ for c in type(e).__mro__}
    if "ClientAuthenticationError" in names:
        return "credentials"
    if names & {"ServiceRequestError", "ServiceResponseError", "ServiceRequestTimeoutError",
                "ServiceResponseTimeoutError"}:  # fmt: skip
        return "unreachable"
    return None


def block_id(token: str, number: int) -> str:
    """The id of part `number` of one upload (`token`): `token-NNNNNN`, so every id of a blob
    has the same length (Azure requires it), sorts in part order, and another upload's never
    match. The SDK sends it base64-encoded, as the store wants, and decodes listed ids."""
    return f"{token}-{number:06d}"


#: adlfs (`az://`, `abfs://`, `abfss://`): its client retries what is transient (see above).
BACKEND = Backend(
    protocols=("az", "abfs", "abfss"),
    lease="ram_dist.io.lease.azure:AzureStore",
    sink="ram_dist.io.sinks.azure:AzureSink",
    client_errors=("azure.core.exceptions:AzureError",),
    errors=StoreErrors(
        error_code,
        error_message,
        client_failure,
        kinds=CODES,
        root="container",
        root_missing=frozenset({"ContainerNotFound"}),
        expired=frozenset({"ExpiredAuthenticationToken"}),
        credentials="Azure: connection string or account key",
    ),
)
