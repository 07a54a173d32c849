"""What ram-dist does differently for each kind of store, in one table keyed by protocol (as
fsspec's own registry is): a new kind of store is one entry in `BACKENDS`.

Classes are named as `"module:name"` and imported when first used, as fsspec names its
filesystems: the modules they live in import `storage`, which reads this table.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import fsspec

from ram_dist.io import s3

#: Protocols that name one another.
ALIASES = {"s3a": "s3", "gcs": "gs"}


@dataclass(frozen=True)
class Backend:
    """One kind of store."""

    lease: str = "ram_dist.io.lease.best_effort:FsspecStore"
    """The `LeaseStore` class that claims an output location (`for_location` builds it)."""
    sink: str = "ram_dist.io.sinks.driver:DriverSink"
    """The `OutputSink` class that writes shards there (`choose` builds it)."""
    fs_options: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Completes the storage options given for this protocol (S3: botocore's retries)."""
    client_errors: tuple[str, ...] = ()
    """Its client's errors that are no `OSError` (store failures, not bugs)."""
    retried_here: bool = False
    """Its client retries nothing itself: `storage` retries what is transient."""
    in_process: bool = False
    """Its files are read in this process (no round trip to save on a first read)."""
    threaded_reads: bool = False
    """A synchronous filesystem safe to call from several threads at once."""


LOCAL = Backend(
    lease="ram_dist.io.lease.local:LocalStore",
    sink="ram_dist.io.sinks.file:FileSink",
    in_process=True,
)
HTTP = Backend(client_errors=("aiohttp:ClientError",), retried_here=True)
#: adlfs (`az://`, `abfs://`, `abfss://`): its client retries what is transient (see `azure`).
AZURE = Backend(
    lease="ram_dist.io.lease.azure:AzureStore",
    sink="ram_dist.io.sinks.azure:AzureSink",
    client_errors=("azure.core.exceptions:AzureError",),
)
BACKENDS: dict[str, Backend] = {
    "file": LOCAL,
    "local": LOCAL,
    "memory": Backend(in_process=True),
    "s3": Backend(
        lease="ram_dist.io.lease.s3:S3Store",
        sink="ram_dist.io.sinks.s3:S3Sink",
        fs_options=s3.fs_options,
        client_errors=("botocore.exceptions:BotoCoreError", "botocore.exceptions:ClientError"),
    ),
    "gs": Backend(
        lease="ram_dist.io.lease.gcs:GcsStore",
        sink="ram_dist.io.sinks.gcs:GcsSink",
        client_errors=("gcsfs.retry:HttpError",),
    ),
    "hf": Backend(threaded_reads=True),
    "az": AZURE,
    "abfs": AZURE,
    "abfss": AZURE,
    "http": HTTP,
    "https": HTTP,
}
#: Any other fsspec filesystem: a best-effort lease, shards streamed through the driver.
DEFAULT = Backend()


def protocol_of(url: str) -> str:
    """`s3`, `gs`, `hf`, `file`, ... of a URL (a plain path is `file`)."""
    protocol = fsspec.utils.get_protocol(url)
    return ALIASES.get(protocol, protocol)


def backend(protocol: str) -> Backend:
    """The backend of a protocol (an alias or an unknown one included)."""
    return BACKENDS.get(ALIASES.get(protocol, protocol), DEFAULT)


def backend_of(url: str) -> Backend:
    return backend(protocol_of(url))


@cache
def load(name: str) -> Any:
    """The object a `"module:name"` entry names; `ImportError` when its module is missing."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


@lru_cache(maxsize=1)
def client_errors() -> tuple[type[BaseException], ...]:
    """Store client errors that are no `OSError`, from the clients installed."""
    found: list[type[BaseException]] = []
    for entry in dict.fromkeys(n for b in BACKENDS.values() for n in b.client_errors):
        try:
            found.append(load(entry))
        except ImportError:
            pass
    return tuple(found)
