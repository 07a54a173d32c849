"""The lease on any other fsspec filesystem (hf://, memory://, ...): best effort
only, as these stores have no conditional create."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseStore, Seen, parse

#: Wait this long after writing a lease before reading it back.
SETTLE_S = 0.25


class FsspecStore(LeaseStore):
    """Best effort for stores without a conditional create: check, write, read back."""

    def prepare(self) -> None:
        with contextlib.suppress(Exception):
            self.fs.makedirs(self.fs._parent(self.path), exist_ok=True)

    def create(self, data: bytes) -> Any | None:
        self.fs.invalidate_cache(self.path)
        if self.fs.exists(self.path):
            return None
        self.fs.pipe_file(self.path, data)
        time.sleep(SETTLE_S)
        seen = self.read()
        return seen.version if seen is not None and seen.version == data else None

    def read(self) -> Seen | None:
        self.fs.invalidate_cache(self.path)
        try:
            data = self.fs.cat_file(self.path, start=0, end=MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            modified: float | None = self.fs.modified(self.path).timestamp()
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001  (not every filesystem gives a time)
            modified = None
        return Seen(parse(data), modified, bytes(data))

    def replace(self, data: bytes, version: Any) -> Any | None:
        seen = self.read()
        if seen is None or seen.version != version:
            return None
        self.fs.pipe_file(self.path, data)
        return data

    def remove(self, version: Any) -> bool:
        seen = self.read()
        if seen is None or seen.version != version:
            return False
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            return False
        return True
