"""Facts about S3 that ram-dist relies on, kept in one place: its multipart upload limits
(the planner cuts parts by them), its retry configuration, its error codes and how to read
them off an error, whether this botocore sends conditional writes, and its entry of the
backend table (`BACKEND`). Imports nothing of ram-dist but `backend`, so every io module
(and the planner) may use it.

s3fs turns a botocore `ClientError` into a builtin exception (`FileExistsError` for a failed
`If-None-Match`, `OSError(EINVAL)` for a failed `If-Match`, `FileNotFoundError`, ...) with the
`ClientError` as `__cause__`; its `response` holds the error code and the HTTP status.
"""

from __future__ import annotations

import functools
from typing import Any

from ram_dist.io.backend import Backend, StoreErrors

#: S3's limits on a multipart upload: every part but the last at least 5 MiB, at most
#: 10,000 parts (other S3-compatible stores take the same limits).
MIN_PART_BYTES = 5 * 2**20
MAX_PARTS = 10_000

#: botocore's retry configuration for S3, unless the storage options give their own
#: (`{"s3": {"config_kwargs": {"retries": {...}}}}`): its standard mode retries throttling
#: (SlowDown, 429), 5xx answers, timeouts and broken connections, with exponential backoff
#: and jitter, and nothing else (a denied or missing object fails at once). s3fs itself tries
#: a request that failed with SlowDown or a broken response body up to 5 times more.
RETRIES = {"mode": "standard", "total_max_attempts": 8}

#: S3 error codes, by what they mean here (`backend.KINDS`).
CODES = {
    "missing": frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NoSuchVersion", "404",
                          "NotFound"}),
    "denied": frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidPayer",
                         "InvalidObjectState", "403", "Forbidden"}),
    "credentials": frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                              "InvalidToken", "TokenRefreshRequired", "RequestTimeTooSkewed",
                              "AuthorizationHeaderMalformed", "InvalidSecurity", "401"}),
    "throttled": frozenset({"SlowDown", "Throttling", "ThrottlingException",
                            "RequestLimitExceeded", "TooManyRequests",
                            "TooManyRequestsException", "429"}),
    "server": frozenset({"InternalError", "ServiceUnavailable", "RequestTimeout", "500", "502",
                         "503", "504"}),
}  # fmt: skip
#: ... and for a conditional request (`If-None-Match`, `If-Match`): the condition failed (412),
#: another conditional write to the key is in flight (409: retry), the key itself is missing
#: (not its bucket), or the store does not take the condition.
CONDITIONAL = {
    "precondition": frozenset({"PreconditionFailed"}),
    "conflict": frozenset({"ConditionalRequestConflict", "OperationAborted"}),
    "missing": frozenset({"NoSuchKey", "404", "NotFound"}),
    "unsupported": frozenset({"NotImplemented", "InvalidArgument"}),
}


def fs_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """s3fs's options with botocore's retry configuration (`RETRIES`) unless they set one."""
    config = dict(kwargs.get("config_kwargs") or {})
    config.setdefault("retries", dict(RETRIES))
    return {**kwargs, "config_kwargs": config}


def error_code(e: BaseException) -> tuple[str | None, int | None] | None:
    """The S3 error code and HTTP status a botocore `ClientError` holds (either None where
    its response does not say), or None when `e` holds no S3 response."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return None
    code = (response.get("Error") or {}).get("Code")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return (str(code) if code else None), (status if isinstance(status, int) else None)


def error_message(e: BaseException) -> str:
    """The message of the S3 error response `e` holds, or ""."""
    return (getattr(e, "response", {}).get("Error") or {}).get("Message") or ""


def client_failure(e: BaseException) -> str | None:
    """What an error botocore raises without a response means: "credentials" (none, or
    none it could get), "unreachable" (no connection, a timeout), or None."""
    try:
        from botocore import exceptions as b
    except ImportError:
        return None
    if isinstance(e, (b.NoCredentialsError, b.PartialCredentialsError,
                      b.CredentialRetrievalError, b.TokenRetrievalError)):  # fmt: skip
        return "credentials"
    if isinstance(e, (b.EndpointConnectionError, b.ConnectTimeoutError, b.ReadTimeoutError,
                      b.ConnectionClosedError, b.HTTPClientError)):  # fmt: skip
        return "unreachable"
    return None


@functools.lru_cache(maxsize=1)
def conditional_writes() -> bool:
    """Whether this botocore sends PutObject's IfNoneMatch/IfMatch (s3fs silently drops
    parameters its botocore does not know)."""
    try:
        import botocore.session

        model = botocore.session.get_session().get_service_model("s3")
        members = model.operation_model("PutObject").input_shape.members
        return "IfNoneMatch" in members and "IfMatch" in members
    except Exception:  # noqa: BLE001
        return False


BACKEND = Backend(
    protocols=("s3",),
    aliases=("s3a",),
    lease="ram_dist.io.lease.s3:S3Store",
    sink="ram_dist.io.sinks.s3:S3Sink",
    fs_options=fs_options,
    client_errors=("botocore.exceptions:BotoCoreError", "botocore.exceptions:ClientError"),
    errors=StoreErrors(
        error_code,
        error_message,
        client_failure,
        kinds=CODES,
        root="bucket",
        root_missing=frozenset({"NoSuchBucket"}),
        expired=frozenset({"ExpiredToken", "TokenRefreshRequired"}),
        credentials="access key, secret and session token",
        conditional=CONDITIONAL,
    ),
)
