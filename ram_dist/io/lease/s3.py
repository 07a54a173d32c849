"""The lease on S3 (s3fs): conditional `PutObject` and `DeleteObject` (`If-None-Match: *`,
`If-Match` an ETag), so the store itself makes the claim exclusive."""

from __future__ import annotations

import functools
import time
from typing import Any

from fsspec.asyn import sync

from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseStore, Seen, parse


class S3Store(LeaseStore):
    """Conditional requests through s3fs's own client (`call_s3`)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One request; a 409 ConditionalRequestConflict (a concurrent conditional write
        in flight) is retried, as S3 asks."""
        for attempt in range(5):
            try:
                return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
            except Exception as e:
                if _s3_error(e) != "conflict" or attempt == 4:
                    raise
                time.sleep(0.05 * 2**attempt)
            finally:
                self.fs.invalidate_cache(self.path)
        raise AssertionError("unreachable")

    def create(self, data: bytes) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfNoneMatch="*")["ETag"]
        except Exception as e:
            if _s3_error(e) == "precondition":
                return None
            raise

    def read(self) -> Seen | None:
        async def get() -> tuple[bytes, str, float]:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with resp["Body"] as body:
                data = await body.read(MAX_LEASE_BYTES + 1)
            return data, resp["ETag"], resp["LastModified"].timestamp()

        try:
            data, etag, modified = sync(self.fs.loop, get)
        except Exception as e:
            if _s3_error(e) == "missing":
                return None
            raise
        return Seen(parse(data), modified, etag)

    def replace(self, data: bytes, version: Any) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfMatch=version)["ETag"]
        except Exception as e:
            if _s3_error(e) not in ("precondition", "missing"):
                raise
        # A retried request whose first try landed fails its condition: was it ours?
        seen = self.read()
        if seen is not None and seen.holder is not None and parse(data) == seen.holder:
            return seen.version
        return None

    def take_over(self, data: bytes, version: Any) -> Any | None:
        return self.replace(data, version)  # one conditional PutObject

    def remove(self, version: Any) -> bool:
        try:
            self._call("delete_object", IfMatch=version)
            return True
        except Exception as e:
            kind = _s3_error(e)
            if kind in ("precondition", "missing"):
                return False
            if kind != "unsupported":
                raise
        # A store without conditional deletes: check, then delete (a small race).
        seen = self.read()
        if seen is None or seen.version != version:
            return False
        self._call("delete_object")
        return True


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


def _s3_error(error: BaseException) -> str | None:
    """What an s3fs/botocore error means here: "precondition" (412 PreconditionFailed),
    "conflict" (409 ConditionalRequestConflict), "missing" (404), "unsupported" (501 or a
    store refusing the conditional header), or None.

    s3fs turns a botocore `ClientError` into a builtin exception (`FileExistsError` for a
    failed `If-None-Match`, `OSError(EINVAL)` for a failed `If-Match`, `FileNotFoundError`)
    with the `ClientError` as `__cause__`; its `response` holds the code and HTTP status."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain and len(chain) < 16:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        response = getattr(e, "response", None)
        if not isinstance(response, dict):
            continue
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code == "PreconditionFailed" or status == 412:
            return "precondition"
        if code in ("ConditionalRequestConflict", "OperationAborted") or status == 409:
            return "conflict"
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return "missing"
        if code in ("NotImplemented", "InvalidArgument") or status == 501:
            return "unsupported"
        return None
    if isinstance(error, FileExistsError):
        return "precondition"
    if isinstance(error, FileNotFoundError):
        return "missing"
    return None
