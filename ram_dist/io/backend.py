"""One kind of store as its own module declares it: what ram-dist does differently for it
(`Backend`) and how its client's errors say what went wrong (`StoreErrors`). `backends`
gathers the entries into its table; `failures` and `checkpoint` ask them, so a new kind of
store is one module that declares its `Backend` (docs/extending.md). Imports nothing of
ram-dist, so every store module may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: What a store's error code may mean, in the order `failures` asks (see `Failure.kind`).
KINDS = ("missing", "denied", "credentials", "throttled", "server")
#: What a failed conditional request may mean (see `failures.conditional`).
CONDITIONS = ("precondition", "conflict", "missing", "unsupported")


@dataclass(frozen=True, eq=False)
class StoreErrors:
    """How one store's client says what went wrong: the code its error answers carry, read
    off an error, and what each code means here."""

    code: Callable[[BaseException], tuple[str | None, int | None] | None]
    """The store's error code and HTTP status an error holds (either None where it does not
    say), or None when the error holds no answer of this store."""
    message: Callable[[BaseException], str]
    """The store's own message in an error `code` read, or ""."""
    client_failure: Callable[[BaseException], str | None] = lambda _: None
    """What an error of its client without an answer means ("credentials", "unreachable"),
    or None."""
    kinds: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Its error codes by what they mean (`KINDS`); a code in none goes by its HTTP status."""
    root: str = "bucket"
    """What the store calls the top of a URL (a bucket, a container)."""
    root_missing: frozenset[str] = frozenset()
    """The codes that say the `root` itself does not exist (a URL to fix, not a file)."""
    expired: frozenset[str] = frozenset()
    """The codes that say the credentials have expired (to renew, not to fix)."""
    credentials: str = ""
    """What credentials the job may run with, in words, for a refused one."""
    conditional: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Its codes for a failed conditional write by what they mean (`CONDITIONS`); empty where
    its client raises `FileExistsError` and `FileNotFoundError` instead."""

    def kind(self, code: str) -> str | None:
        """What `code` means (`KINDS`), or None."""
        return next((k for k in KINDS if code in self.kinds.get(k, ())), None)


@dataclass(frozen=True, eq=False)
class Backend:
    """One kind of store, under the fsspec protocols it answers to (an entry is known by its
    identity, as the table holds it)."""

    protocols: tuple[str, ...] = ()
    """Its fsspec protocols, each a key of `backends.BACKENDS`."""
    aliases: tuple[str, ...] = ()
    """Protocols that name its first one (their URLs take that one's storage options)."""
    lease: str = "ram_dist.io.lease.best_effort:FsspecStore"
    """The `LeaseStore` class that claims an output location (`for_location` builds it)."""
    sink: str = "ram_dist.io.sinks.driver:DriverSink"
    """The `OutputSink` class that writes shards there (`choose` builds it)."""
    fs_options: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Completes the storage options given for this protocol (S3: botocore's retries)."""
    client_errors: tuple[str, ...] = ()
    """Its client's errors that are no `OSError` (store failures, not bugs)."""
    errors: StoreErrors | None = None
    """How its client's errors say what went wrong; None: only by HTTP status and errno."""
    retried_here: bool = False
    """Its client retries nothing itself: `storage` retries what is transient."""
    in_process: bool = False
    """Its files are read in this process (no round trip to save on a first read)."""
    threaded_reads: bool = False
    """A synchronous filesystem safe to call from several threads at once."""
