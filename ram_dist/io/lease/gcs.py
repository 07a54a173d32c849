"""The lease on GCS (gcsfs): uploads and deletes with `ifGenerationMatch` (0 to create, the
generation last seen to renew, take over or release), so the store itself makes the claim
exclusive."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from ram_dist.io import gcs
from ram_dist.io.failures import conditional
from ram_dist.io.lease.best_effort import FsspecStore
from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseStore, Seen, parse

#: Reads of the lease when it changes between its metadata and its bytes.
READ_TRIES = 3


class GcsStore(LeaseStore):
    """Conditional requests through gcsfs's own client (`_call`); a version is a generation."""

    def __init__(self, fs: Any, path: str) -> None:
        super().__init__(fs, path)
        self.bucket, self.key, _ = fs.split_path(path)

    @classmethod
    def for_location(cls, url: str, fs: AbstractFileSystem, path: str) -> LeaseStore:
        """Best effort (`FsspecStore`) on a filesystem that is not gcsfs's."""
        if hasattr(fs, "_call") and hasattr(fs, "_location"):
            return cls(fs, path)
        return FsspecStore(fs, path)

    def _run(self, coro: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return sync(self.fs.loop, coro, self.fs, self.bucket, *args, **kwargs)
        finally:
            self.fs.invalidate_cache(self.path)

    def _upload(self, data: bytes, generation: int) -> int | None:
        try:
            answer = self._run(gcs.upload, self.key, data, if_generation_match=generation)
        except Exception as e:
            if conditional(e) not in ("precondition", "missing"):
                raise
            # A retried request whose first try landed fails its condition: was it ours?
            seen = self.read()
            if seen is not None and seen.holder is not None and parse(data) == seen.holder:
                return int(seen.version)
            return None
        return int(answer["generation"])

    def create(self, data: bytes) -> Any | None:
        return self._upload(data, 0)

    def read(self) -> Seen | None:
        for _ in range(READ_TRIES):
            meta = self._run(gcs.stat, self.key)
            if meta is None:
                return None
            if int(meta.get("size", 0)) > MAX_LEASE_BYTES:
                return Seen(None, _time(meta), int(meta["generation"]))
            data = self._run(gcs.read, self.key, int(meta["generation"]))
            if data is None:
                continue  # replaced or removed since its metadata was read
            return Seen(parse(data), _time(meta), int(meta["generation"]))
        return None

    def replace(self, data: bytes, version: Any) -> Any | None:
        return self._upload(data, int(version))

    def take_over(self, data: bytes, version: Any) -> Any | None:
        return self.replace(data, version)  # one conditional upload

    def remove(self, version: Any) -> bool:
        try:
            return bool(self._run(gcs.delete, self.key, if_generation_match=int(version)))
        except Exception as e:
            if conditional(e) == "precondition":
                return False
            raise


def _time(meta: dict[str, Any]) -> float | None:
    """When the store last wrote the object (its `updated`), in epoch seconds."""
    stamp = meta.get("updated")
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
