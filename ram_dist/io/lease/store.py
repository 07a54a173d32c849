"""The lease record (`Holder`) and the conditional operations a lease needs from a store;
one module per kind of store implements them (`local`, `s3`, `best_effort`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from fsspec import AbstractFileSystem

from ram_dist.errors import RamDistError

#: Most bytes read from a lease; a longer one is unreadable (an unknown holder).
MAX_LEASE_BYTES = 64 * 1024


class LeaseHeld(RamDistError):
    """Another live run holds the output location."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: a job on a host, its process, when it took and last renewed the
    lease (epoch seconds). `machine` (this boot of this host and its pid namespace, where the
    platform says) keeps two machines or containers that share a host name apart before a
    holder is judged by its pid."""

    job: str
    host: str
    pid: int
    started: float
    renewed: float
    machine: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Holder:
        """Parse a lease; `ValueError` when it is not one."""
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("a lease is a JSON object")
        job, host, pid = value.get("job"), value.get("host"), value.get("pid")
        started, renewed = value.get("started"), value.get("renewed")
        machine = value.get("machine", "")
        if not (isinstance(job, str) and isinstance(host, str) and isinstance(machine, str)):
            raise ValueError("job, host and machine are strings")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ValueError("pid is an integer")
        for t in (started, renewed):
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
                raise ValueError("started and renewed are epoch seconds")
        return cls(job, host, pid, float(started), float(renewed), machine)

    def same_claim(self, other: Holder | None) -> bool:
        """The same acquisition by the same process (renewals differ only in `renewed`)."""
        return other is not None and (
            self.job,
            self.host,
            self.pid,
            self.started,
            self.machine,
        ) == (other.job, other.host, other.pid, other.started, other.machine)


@dataclass(frozen=True)
class Seen:
    """A lease as read: its holder (None when unreadable), when the store last modified it
    (epoch seconds, None when the store does not say) and a version that changes with every
    write (inode/time/size, an ETag, or the bytes themselves)."""

    holder: Holder | None
    modified: float | None
    version: Any


def parse(data: bytes) -> Holder | None:
    """The holder a lease's bytes name, or None when they are not a lease."""
    if len(data) > MAX_LEASE_BYTES:
        return None
    try:
        return Holder.from_json(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


class LeaseStore:
    """The conditional operations a lease needs from one kind of store."""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = path

    @classmethod
    def for_location(cls, url: str, fs: AbstractFileSystem, path: str) -> LeaseStore:
        """The store for the lease at `url` (`path` inside `fs`): this kind, unless the
        client cannot do what it needs."""
        return cls(fs, path)

    def prepare(self) -> None:
        """Make the output location able to hold the lease."""

    def create(self, data: bytes) -> Any | None:
        """Create the lease if there is none: its version, or None when one exists."""
        raise NotImplementedError

    def read(self) -> Seen | None:
        """The lease, or None when there is none."""
        raise NotImplementedError

    def replace(self, data: bytes, version: Any) -> Any | None:
        """Write `data` if the lease is still at `version`: the new version, or None."""
        raise NotImplementedError

    def remove(self, version: Any) -> bool:
        """Delete the lease if it is still at `version`; False when it was not."""
        raise NotImplementedError

    def take_over(self, data: bytes, version: Any) -> Any | None:
        """Replace the lease at `version` (judged dead or stale) by `data`: the new version,
        or None when the lease changed first or another run won the take-over."""
        if not self.remove(version):
            return None
        return self.create(data)
