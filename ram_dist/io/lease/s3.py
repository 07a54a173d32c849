"""The lease on S3 (s3fs): conditional `PutObject` and `DeleteObject` (`If-None-Match: *`,
`If-Match` an ETag), so the store itself makes the claim exclusive."""

from __future__ import annotations

import logging
import time
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ram_dist.io.failures import conditional
from ram_dist.io.lease.best_effort import FsspecStore
from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseStore, Seen, parse
from ram_dist.io.s3 import conditional_writes

log = logging.getLogger("ram_dist.io.lease")


class S3Store(LeaseStore):
    """Conditional requests through s3fs's own client (`call_s3`)."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self.bucket, self.key, _ = fs.split_path(path)

    @classmethod
    def for_location(cls, url: str, fs: AbstractFileSystem, path: str) -> LeaseStore:
        """Best effort (`FsspecStore`) where s3fs or its botocore cannot send conditional
        writes."""
        if hasattr(fs, "call_s3") and conditional_writes():
            return cls(fs, path)
        log.warning(
            "%s: this botocore does not know conditional PutObject (IfNoneMatch/IfMatch); "
            "the output lease is best effort only. Upgrade botocore/s3fs to make it exclusive.",
            url,
        )
        return FsspecStore(fs, path)

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One request; a 409 ConditionalRequestConflict (a concurrent conditional write
        in flight) is retried, as S3 asks."""
        for attempt in range(5):
            try:
                return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
            except Exception as e:
                if conditional(e) != "conflict" or attempt == 4:
                    raise
                time.sleep(0.05 * 2**attempt)
            finally:
                self.fs.invalidate_cache(self.path)
        raise AssertionError("unreachable")

    def create(self, data: bytes) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfNoneMatch="*")["ETag"]
        except Exception as e:
            if conditional(e) == "precondition":
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
            if conditional(e) == "missing":
                return None
            raise
        return Seen(parse(data), modified, etag)

    def replace(self, data: bytes, version: Any) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfMatch=version)["ETag"]
        except Exception as e:
            if conditional(e) not in ("precondition", "missing"):
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
            kind = conditional(e)
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
