"""What ram-dist does differently for each kind of store, in one table keyed by protocol (as
fsspec's own registry is), built from the entries the stores declare: a kind of store with a
module of its own (`s3`, `gcs`, `azure`) declares its `Backend` there, error codes included,
and is listed in `STORES`; one that needs nothing of its own is a line here. A store from
outside ram-dist joins with `register`.

Classes are named as `"module:name"` and imported when first used, as fsspec names its
filesystems: the modules they live in import `storage`, which reads this table.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

import fsspec

from ram_dist.io import azure, gcs, s3
from ram_dist.io.backend import Backend, StoreErrors

#: Local files (a plain path, `file://`, `local://`): an exclusive-create lease, shards
#: written in place by the workers.
LOCAL = Backend(
    protocols=("file", "local"),
    lease="ram_dist.io.lease.local:LocalStore",
    sink="ram_dist.io.sinks.file:FileSink",
    in_process=True,
)
MEMORY = Backend(protocols=("memory",), in_process=True)
#: huggingface_hub's `HfFileSystem`: synchronous, its client retries what is transient.
HF = Backend(protocols=("hf",), threaded_reads=True)
#: fsspec's HTTP filesystem: its client retries nothing, its errors are aiohttp's.
HTTP = Backend(
    protocols=("http", "https"), client_errors=("aiohttp:ClientError",), retried_here=True
)
#: Every entry, in the table's order.
STORES: tuple[Backend, ...] = (LOCAL, MEMORY, s3.BACKEND, gcs.BACKEND, HF, azure.BACKEND, HTTP)

#: The entry of each protocol, and the protocols that name another.
BACKENDS: dict[str, Backend] = {}
ALIASES: dict[str, str] = {}
#: Any other fsspec filesystem: a best-effort lease, shards streamed through the driver.
DEFAULT = Backend()


def register(entry: Backend) -> None:
    """Add a kind of store to the table (one whose protocols it holds is refused): its
    protocols and aliases take this entry from now on, in this process."""
    taken = [p for p in (*entry.protocols, *entry.aliases) if p in BACKENDS or p in ALIASES]
    if not entry.protocols or taken:
        raise ValueError(f"a backend needs protocols of its own; taken: {taken}")
    for protocol in entry.protocols:
        BACKENDS[protocol] = entry
    for alias in entry.aliases:
        ALIASES[alias] = entry.protocols[0]
    client_errors.cache_clear()


def unregister(entry: Backend) -> None:
    """Take a kind of store `register` added out of the table again."""
    for table in (BACKENDS, ALIASES):
        for protocol in (*entry.protocols, *entry.aliases):
            table.pop(protocol, None)
    client_errors.cache_clear()


def protocol_of(url: str) -> str:
    """`s3`, `gs`, `hf`, `file`, ... of a URL (a plain path is `file`)."""
    protocol = fsspec.utils.get_protocol(url)
    return ALIASES.get(protocol, protocol)


def backend(protocol: str) -> Backend:
    """The backend of a protocol (an alias or an unknown one included)."""
    return BACKENDS.get(ALIASES.get(protocol, protocol), DEFAULT)


def backend_of(url: str) -> Backend:
    return backend(protocol_of(url))


def store_errors() -> list[StoreErrors]:
    """How each store's client words its errors, in the table's order."""
    entries = dict.fromkeys(BACKENDS.values())
    return [b.errors for b in entries if b.errors is not None]


@cache
def load(name: str) -> Any:
    """The object a `"module:name"` entry names; `ImportError` when its module is missing."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


@cache
def client_errors() -> tuple[type[BaseException], ...]:
    """Store client errors that are no `OSError`, from the clients installed."""
    found: list[type[BaseException]] = []
    for entry in dict.fromkeys(n for b in BACKENDS.values() for n in b.client_errors):
        try:
            found.append(load(entry))
        except ImportError:
            pass
    return tuple(found)


for _entry in STORES:
    register(_entry)
