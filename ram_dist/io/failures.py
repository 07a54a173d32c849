"""What a failed read or write means to the person running the job, decided in one place.

A store or disk fails with an `OSError` (its errno says why), with a store client's error
that holds the store's own error code (botocore's `ClientError`, or s3fs's translation of
it: a builtin `OSError` whose `__cause__` is the `ClientError`; azure-core's errors), with
aiohttp's or gcsfs's HTTP errors, or with a timeout. What a store's codes mean is the
store's own business: its backend entry's `StoreErrors` (`backend`) reads the code off an
error and says what it means; nothing here names a store. `storage_error` turns any of them,
plus the URL being read or written, into a `StorageError`: one line naming the input or
output and the file, saying what happened and what to do, with an exit status of 2 when the
user must fix something (a missing file or bucket, a denied permission, refused or expired
credentials, an input changed while the job ran) and 1 when the job failed for a reason that
may pass (a full disk, a store still throttling or failing after its retries, a store out of
reach). Retrying is the store client's business (botocore's retry mode for S3, see
`storage`); `transient` says which failures are worth another try where a client has none.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlparse

from ram_dist.errors import RamDistError, StorageError
from ram_dist.io.backend import StoreErrors
from ram_dist.io.backends import client_errors, store_errors

#: errnos, by what they mean here.
ERRNO_MISSING = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})
ERRNO_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
ERRNO_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
ERRNO_UNREACHABLE = frozenset({errno.ETIMEDOUT, errno.ECONNREFUSED, errno.ECONNRESET,
                               errno.EHOSTUNREACH, errno.ENETUNREACH})  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """What went wrong, in words, and the exit status it earns."""

    kind: str
    """missing, denied, credentials, full, throttled, server, unreachable, changed, other."""
    detail: str
    """The store's or the system's own words (an S3 error code, an errno name)."""
    status: int | None = None
    """The HTTP status, where the store answered."""
    root: str | None = None
    """Where the store said the top of the URL itself is missing: what it calls it ("bucket",
    "container"); the URL is then to fix, not a file."""
    expired: bool = False
    """Whether the store said the credentials have expired."""

    @property
    def exit_status(self) -> int:
        return 2 if self.kind in ("missing", "denied", "credentials", "changed") else 1

    @property
    def transient(self) -> bool:
        return self.kind in ("throttled", "server", "unreachable")


class ChangedError(OSError):
    """An input file is not what its header said when the job started (shorter, replaced)."""


def is_storage_failure(error: BaseException) -> bool:
    """Whether `error` is a store's or disk's failure (not a bug, not our own check)."""
    return isinstance(error, (OSError, *client_errors())) and not isinstance(error, RamDistError)


def classify(error: BaseException) -> Failure:
    """What `error` (or what caused it) means: the most specific answer along its chain,
    the store's error code first, then the HTTP status, then the exception's type and errno."""
    chain = causes(error)
    stores = store_errors()
    for e in chain:
        for store in stores:
            code, status = store.code(e) or (None, None)
            if code is not None:
                return _by_code(store, code, status, e)
    for e in chain:
        status = _http_status(e)
        if status is not None:
            return _by_status(status, e)
    for e in chain:
        found = _by_type(e)
        if found is not None:
            return found
    return Failure("other", _words(error))


def causes(error: BaseException) -> list[BaseException]:
    """`error` and what caused it, in order (`__cause__`, else `__context__`), at most 16:
    a store client's own error often hides behind the builtin one it was translated to."""
    out: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in out and len(out) < 16:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


#: The HTTP status of each meaning of a failed conditional request (`backend.CONDITIONS`).
CONDITION_STATUS = {"precondition": 412, "conflict": 409, "missing": 404, "unsupported": 501}


def conditional(error: BaseException) -> str | None:
    """What a failed conditional request means: "precondition" (412), "conflict" (409,
    retry), "missing" (404), "unsupported" (501, or a store refusing the condition), or None.
    The first answer along the chain of a store with codes for it (`StoreErrors.conditional`:
    S3) decides; without one, the client's builtin exception does (s3fs's translation,
    gcsfs's)."""
    stores = [s for s in store_errors() if s.conditional]
    for e in causes(error):
        for store in stores:
            found = store.code(e)
            if found is None:
                continue
            code, status = found
            for meaning, codes in store.conditional.items():
                if code in codes or status == CONDITION_STATUS[meaning]:
                    return meaning
            return None
    if isinstance(error, FileExistsError):
        return "precondition"
    if isinstance(error, FileNotFoundError):
        return "missing"
    return None


def transient(error: BaseException) -> bool:
    """Worth another try: throttling, a server error, a timeout or a broken connection."""
    return classify(error).transient


def storage_error(
    error: BaseException, url: str | None, action: str, role: str | None = None
) -> StorageError:
    """The one-line error for a failed `action` ("read", "write", "list", ...) of `url`, an
    `role` ("input", "output") of the job; `url` None when nobody knew the file."""
    if isinstance(error, StorageError):
        return error
    where = " ".join(p for p in (role, url) if p) or "storage"
    return explained(f"{where}: cannot {action}", error, url, action)


def explained(prefix: str, error: BaseException, url: str | None, action: str) -> StorageError:
    """`prefix: what happened; what to do` as a `StorageError` with the failure's status."""
    failure = classify(error)
    message = f"{prefix}: {_explain(failure, url, action)}"
    return StorageError(" ".join(message.split()), failure.exit_status)


@contextmanager
def reported(url: str | None, action: str, role: str | None = None) -> Iterator[None]:
    """Within this, a store's or disk's failure is raised as `storage_error`; anything else
    (our own checks, bugs) passes unchanged."""
    try:
        yield
    except BaseException as e:
        if is_storage_failure(e):
            raise storage_error(e, url, action, role) from e
        raise


#: What to do about a failure of each kind whose advice depends on nothing but its detail
#: (`{detail}`: the store's own words, in parentheses).
_ADVICE = {
    "denied": "permission denied{detail}; check the bucket policy or the file permissions, "
    "and what the credentials may do",
    "full": "no space left on the device{detail}; free space (or choose another location) "
    "and run again: a re-run resumes",
    "throttled": "the store is still throttling requests after its retries{detail}; run "
    "again later or with fewer --workers: a re-run resumes",
    "server": "the store failed after its retries{detail}; run again: a re-run resumes",
    "unreachable": "the store could not be reached{detail}; check the endpoint and the "
    "network, then run again: a re-run resumes",
}


def _explain(failure: Failure, url: str | None, action: str) -> str:
    detail = f" ({failure.detail})" if failure.detail else ""
    kind = failure.kind
    if kind == "missing":
        bucket = _bucket(url)
        if failure.root and bucket:
            return (f"{failure.root} {bucket} does not exist{detail}; fix the URL or create the "
                    f"{failure.root}")  # fmt: skip
        if action == "read":
            return (f"no such file{detail}; was it deleted or moved while the job ran? "
                    "Restore it and run again")  # fmt: skip
        if "EISDIR" in failure.detail:
            return f"a folder is in the way{detail}; move it or fix the path"
        if "ENOTDIR" in failure.detail:
            return f"a file is in the way of a folder{detail}; move it or fix the path"
        return f"no such file or folder{detail}; fix the path or URL"
    if kind in _ADVICE:
        return _ADVICE[kind].format(detail=detail)
    if kind == "credentials":
        if failure.expired:
            return f"the credentials have expired{detail}; renew them and run again"
        hint = "; ".join(s.credentials for s in store_errors() if s.credentials)
        hint = f" ({hint})" if hint else ""
        return (f"the store refused the credentials{detail}; check the credentials the job "
                f"runs with{hint}")  # fmt: skip
    if kind == "changed":
        return (f"{failure.detail}; the file changed while the job ran: restore it, or run "
                "again to merge what it holds now")  # fmt: skip
    return failure.detail or "failed"


def _by_code(store: StoreErrors, code: str, status: int | None, e: BaseException) -> Failure:
    message = store.message(e)
    detail = f"HTTP {code}" if code.isdigit() else code
    if message and message not in (code, "Forbidden", "Not Found"):
        detail = f"{detail}: {message}"
    kind = store.kind(code)
    if kind is not None:
        root = store.root if code in store.root_missing else None
        return Failure(kind, detail, status, root, code in store.expired)
    if status is not None:
        return _by_status(status, e, detail)
    return Failure("other", detail)


def _http_status(e: BaseException) -> int | None:
    """The HTTP status of an aiohttp (`status`), gcsfs (`code`) or requests/httpx
    (`response.status_code`) error, asked in that order (aiohttp deprecates `code`)."""
    for get in (
        lambda: getattr(e, "status", None),
        lambda: getattr(e, "code", None),
        lambda: getattr(getattr(e, "response", None), "status_code", None),
    ):
        value = get()
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    return None


def _by_status(status: int, e: BaseException, detail: str | None = None) -> Failure:
    detail = detail or f"HTTP {status}"
    if status == 404:
        return Failure("missing", detail, status)
    if status == 401:
        return Failure("credentials", detail, status)
    if status == 403:
        return Failure("denied", detail, status)
    if status == 429:
        return Failure("throttled", detail, status)
    if status in (408, 500, 502, 503, 504):
        return Failure("server", detail, status)
    return Failure("other", f"{detail}: {_words(e)}", status)


def _by_type(e: BaseException) -> Failure | None:
    if isinstance(e, ChangedError):
        return Failure("changed", _words(e))
    number = getattr(e, "errno", None)
    name = errno.errorcode.get(number, "") if isinstance(number, int) else ""
    detail = f"{name}: {e.strerror}" if name and getattr(e, "strerror", None) else _words(e)
    if isinstance(e, FileNotFoundError) or number in ERRNO_MISSING:
        return Failure("missing", detail)
    if isinstance(e, PermissionError) or number in ERRNO_DENIED:
        return Failure("denied", detail)
    if number in ERRNO_FULL:
        return Failure("full", detail)
    if isinstance(e, (ConnectionError, TimeoutError)) or number in ERRNO_UNREACHABLE:
        return Failure("unreachable", detail)
    kind = next(filter(None, (s.client_failure(e) for s in store_errors())), None)
    if kind is not None:
        return Failure(kind, _words(e))
    if isinstance(e, OSError) and number is not None:
        return Failure("other", detail)
    return None


def _bucket(url: str | None) -> str | None:
    if not url or "://" not in url:
        return None
    return urlparse(url).netloc.split("@")[0] or None  # abfs://container@account...


def _words(e: BaseException) -> str:
    text = str(e).strip()
    return " ".join((text or type(e).__name__).split())
