"""Reading the safetensors headers of many files in a few round trips, whatever the store.

One ranged read per file for its header, all files in flight together (one batched
`cat_ranges` per filesystem), and a second read only for the rare header longer than the
first. A file's size and version come from its folder's listing where the caller has it.
`checkpoint` opens whole checkpoint folders with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem

from ram_dist.errors import CheckpointError
from ram_dist.io.backends import backend, backend_of
from ram_dist.io.failures import is_storage_failure, storage_error
from ram_dist.io.safetensors_header import FileHeader, header_length, parse_header
from ram_dist.io.storage import Storage

#: Bytes of the first read of every safetensors file: the 8-byte length and, in the same
#: request, the header whenever it is shorter. A header takes about 110 bytes per tensor, so
#: a dense model's shard has a few KiB of it, a single-file 7B model ~40 KiB, an MoE shard of
#: a thousand or more expert tensors 100-200 KiB: 256 KiB holds them all. The tensor bytes
#: that come along cost little next to a round trip (2.6 ms at the ~100 MB/s of one S3
#: connection, against tens of ms to the first byte; 191 MiB for the 764 shards of a 405B base
#: and three tasks, which the passes read again). A longer header takes one more read, of
#: the rest only.
FIRST_READ_BYTES = 256 * 1024
#: First reads per batched request: 64 MiB in flight at most (the driver holds a batch until
#: it has cut the headers out), and far more requests than a store runs at once (s3fs keeps
#: 10 connections unless `config_kwargs.max_pool_connections` says more).
FIRST_READ_BATCH = 256
#: Threads reading headers from a synchronous remote filesystem safe to call from several
#: threads (`threaded_reads` in `backends`: `HfFileSystem`). Async filesystems (s3fs, gcsfs)
#: run a batch on their event loop; local and in-memory files are read one after another (no
#: round trip to overlap).
READ_THREADS = 16


#: Keys of `fs.info()` that change when a file's content changes, by store.
VERSION_KEYS = ("ETag", "etag", "blob_id", "md5Hash", "generation", "mtime")


def file_version(info: Mapping[str, object]) -> str | None:
    """What the store says identifies this version of a file (None if it says nothing)."""
    for key in VERSION_KEYS:
        if info.get(key) is not None:
            return f"{key}:{info[key]}"
    return None


def read_file_headers(
    urls: Sequence[str],
    storage: Storage,
    listed: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[tuple[FileHeader, dict[str, object]]]:
    """Headers and identities of many files, read together; the first error (in the order of
    `urls`) is raised. `listed` holds each file's entry of its folder's listing, where known
    (size and version without another request); a file without one costs an `fs.info`."""
    out = []
    for result in read_headers(urls, storage, listed):
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out


def read_headers(
    urls: Sequence[str],
    storage: Storage,
    listed: Sequence[Mapping[str, Any] | None] | None,
) -> list[tuple[FileHeader, dict[str, object]] | BaseException]:
    """Per file, its header and identity or the error that stopped it (returned, not raised,
    so that the caller reports the first in its own order).

    Two batched steps over all files: `[0, FIRST_READ_BYTES)` of each (clipped to its size;
    8 bytes of a local file), then the rest of each header that was longer. A length over the
    cap or past the end of the file is refused from the first 8 bytes, before anything of that
    size is read."""
    entries = listed if listed is not None else [None] * len(urls)
    files = [_HeaderRead.start(url, storage, e) for url, e in zip(urls, entries, strict=True)]
    todo = [f for f in files if f.error is None]
    for w in range(0, len(todo), FIRST_READ_BATCH):
        window = todo[w : w + FIRST_READ_BATCH]
        blobs = _read(storage, [(f.url, 0, min(f.size, _first_read(f.url))) for f in window])
        for f, data in zip(window, blobs, strict=True):
            f.take_first(data)
    longer = [f for f in todo if f.error is None and len(f.body) < f.length]
    blobs = _read(storage, [(f.url, 8 + len(f.body), 8 + f.length) for f in longer])
    for f, data in zip(longer, blobs, strict=True):
        f.take_rest(data)
    return [f.result() for f in files]


@dataclass
class _HeaderRead:
    """One file's header on its way in: what is known of it so far, or what went wrong."""

    url: str
    size: int = 0
    version: str | None = None
    length: int = 0
    body: bytes = b""
    error: BaseException | None = None

    @classmethod
    def start(cls, url: str, storage: Storage, entry: Mapping[str, Any] | None) -> _HeaderRead:
        try:
            info = _file_info(url, storage, entry)
            return cls(url, size=int(info["size"]), version=file_version(info))
        except Exception as e:  # noqa: BLE001  (returned to the caller, raised in its order)
            return cls(url, error=_read_error(url, e))

    def take_first(self, data: bytes | BaseException) -> None:
        """The first read: the length prefix, and the header unless it is longer."""
        if isinstance(data, BaseException):
            self.error = _read_error(self.url, data)
            return
        try:
            self.length = header_length(data[:8], self.url, self.size)
        except Exception as e:  # noqa: BLE001
            self.error = e
            return
        self.body = data[8 : 8 + self.length]  # without the tensor bytes that came along

    def take_rest(self, data: bytes | BaseException) -> None:
        if isinstance(data, BaseException):
            self.error = _read_error(self.url, data)
        else:
            self.body += data

    def result(self) -> tuple[FileHeader, dict[str, object]] | BaseException:
        if self.error is None and len(self.body) != self.length:
            self.error = CheckpointError(f"{self.url}: header is truncated")
        if self.error is not None:
            return self.error
        try:
            header = parse_header(self.body, self.url, self.size)
        except Exception as e:  # noqa: BLE001
            return e
        return header, {
            "size": self.size,
            "header_sha256": header.header_sha256,
            "version": self.version,
        }


def _first_read(url: str) -> int:
    """Files read in this process (`in_process` in `backends`: no round trip to save) are
    first read for the 8-byte length alone, then exactly the header, instead of copying
    tensor bytes along."""
    return 8 if backend_of(url).in_process else FIRST_READ_BYTES


def _file_info(url: str, storage: Storage, entry: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A file's size and version: its listing entry, or `fs.info` where there is none.

    s3fs, gcsfs and HfFileSystem list what `info` gives (s3fs's `info` even answers from the
    listing it cached), so the version in the identity stays what it was. A local symlink is
    the exception (a Hugging Face cache snapshot): the listing stats the link itself, `info`
    its target, whose mtime the identity has always held."""
    if entry is not None and entry.get("size") is not None and not entry.get("islink"):
        return entry
    fs, path = storage.fs(url)
    return fs.info(path)


def _read(storage: Storage, ranges: list[tuple[str, int, int]]) -> list[bytes | BaseException]:
    """Bytes `[start, end)` of each `(url, start, end)`, or the error that stopped the read:
    one batch per filesystem, its requests in flight together where the store allows."""
    out: list[bytes | BaseException] = [b""] * len(ranges)
    groups: dict[int, tuple[AbstractFileSystem, list[int], list[str]]] = {}
    for i, (url, start, end) in enumerate(ranges):
        if end > start:  # an empty range reads nothing (a zero-byte file)
            fs, path = storage.fs(url)
            fs_group = groups.setdefault(id(fs), (fs, [], []))
            fs_group[1].append(i)
            fs_group[2].append(path)
    for fs, index, paths in groups.values():
        starts = [ranges[i][1] for i in index]
        ends = [ranges[i][2] for i in index]
        try:
            blobs = _cat_ranges(fs, paths, starts, ends)
        except Exception as e:  # noqa: BLE001  (the whole batch failed: each file reports it)
            blobs = [e] * len(index)
        for i, blob in zip(index, blobs, strict=True):
            out[i] = blob
    return out


def _cat_ranges(
    fs: AbstractFileSystem, paths: list[str], starts: list[int], ends: list[int]
) -> list[bytes | BaseException]:
    """`fs.cat_ranges`, errors returned in place; a synchronous remote filesystem's requests
    are spread over threads (`HfFileSystem` would otherwise send them one after another)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if fs.async_impl or not any(backend(p).threaded_reads for p in protocols):
        return fs.cat_ranges(paths, starts, ends, on_error="return")

    def one(path: str, start: int, end: int) -> bytes | BaseException:
        try:  # no read-ahead cache: it would fetch a block (MiBs) past the header
            return fs.cat_file(path, start, end, cache_type="none")
        except Exception as e:  # noqa: BLE001
            return e

    with ThreadPoolExecutor(min(READ_THREADS, len(paths))) as pool:
        return list(pool.map(one, paths, starts, ends))


def _read_error(url: str, error: BaseException) -> BaseException:
    """The error a failed header read reports: a missing file as it has always said, any
    other failure of the store as `failures` words it."""
    if isinstance(error, FileNotFoundError):
        wrapped: BaseException = CheckpointError(f"{url}: file not found")
    elif is_storage_failure(error):
        wrapped = storage_error(error, url, "read", "input")
    else:
        return error
    wrapped.__cause__ = error
    return wrapped
