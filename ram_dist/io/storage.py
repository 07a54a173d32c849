"""Storage through fsspec: URLs kept as strings (pathlib mangles `s3://`), per-protocol options.

Every read and write of ram-dist goes through a `Storage`, which the driver builds once and
ships to the workers. Reads are byte ranges, cut into requests of at most `REQUEST_BYTES`
that the filesystem may run concurrently. Retrying a transient failure is the store client's
job: botocore's own retry mode for S3 (`s3.RETRIES`), gcsfs's, huggingface_hub's and
azure-storage-blob's own retries for gs://, hf:// and Azure Blob (`azure`); only stores whose
client has none (`retried_here` in `backends`) are retried here, and only for what is
transient. A failed read is raised as a one-line
`StorageError` naming the input file (`failures`).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ram_dist.errors import RamDistError
from ram_dist.io import s3
from ram_dist.io.backends import backend, backend_of, protocol_of
from ram_dist.io.failures import ChangedError, storage_error, transient

if TYPE_CHECKING:
    from ram_dist.io.range_cache import InputCache, Traffic

#: Largest single range request; a unit's range is cut into requests this size.
REQUEST_BYTES = 16 * 2**20
#: botocore's retry configuration for S3 (see `s3.RETRIES`).
S3_RETRIES = s3.RETRIES
#: Stores whose client retries nothing itself (fsspec's HTTP filesystem; `retried_here` in
#: `backends`): their transient failures (`failures.transient`) are retried here, `ATTEMPTS`
#: times in all.
ATTEMPTS = 5
BACKOFF_S = 0.25
#: What a range read returns: fetched bytes, or a view of the buffer it was read into.
Buffer = bytes | memoryview


@dataclass(frozen=True)
class Storage:
    """Per-protocol fsspec options, e.g. `{"s3": {"endpoint_url": ...}}`. Picklable.

    Options may hold credentials: `repr` shows protocols and keys, never values.
    """

    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    cache: InputCache | None = field(default=None, compare=False)
    """Set by the driver for a pass's workers: ranges it covers are read from node-local
    disk when an earlier pass kept them there (see `range_cache`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.options, Mapping) or not all(
            isinstance(v, Mapping) for v in self.options.values()
        ):
            raise RamDistError(
                "storage options must map a protocol to its options, "
                'e.g. {"s3": {"endpoint_url": "http://..."}}'
            )

    def __repr__(self) -> str:
        keys = {p: sorted(o) for p, o in self.options.items()}
        return f"Storage({keys})"

    def fs(self, url: str) -> tuple[AbstractFileSystem, str]:
        """The filesystem and the path inside it (fsspec caches the instances)."""
        protocol = protocol_of(url)
        kwargs = dict(self.options.get(protocol, {}))
        complete = backend(protocol).fs_options
        if complete is not None:
            kwargs = complete(kwargs)
        try:
            return fsspec.core.url_to_fs(url, **kwargs)
        except ImportError as e:
            raise RamDistError(f"{url}: {e}") from e
        except ValueError as e:
            if "Protocol not known" in str(e):
                raise RamDistError(f"{url}: no filesystem for protocol {protocol!r}") from e
            raise

    def is_local(self, url: str) -> bool:
        return isinstance(self.fs(url)[0], LocalFileSystem)

    def read_ranges(
        self,
        url_ranges: list[tuple[str, int, int]],
        into: list[memoryview] | None = None,
        traffic: Traffic | None = None,
    ) -> list[Buffer]:
        """Read byte ranges `[start, end)` of the job's input files; empty ranges read
        nothing. A failure is a `StorageError` naming the file.

        With `into` (one writable buffer of each range's length), the bytes land there and
        those buffers are returned: a worker reuses its buffers instead of faulting in fresh
        memory for every block. Local files are read with `preadv` (one copy out of the
        page cache, like plain file I/O); other filesystems get batched `cat_ranges`
        requests of at most `REQUEST_BYTES`. With a `cache`, what it holds is read from it, and
        `traffic` counts what was read from it and written to it."""
        if into is not None and len(into) != len(url_ranges):
            raise ValueError(f"{len(into)} buffers for {len(url_ranges)} ranges")
        if self.cache is None:
            return self._read_direct(url_ranges, into)
        if into is None:
            into = [memoryview(bytearray(end - start)) for _, start, end in url_ranges]
        self.cache.read(url_ranges, into, self._read_direct, self.is_local, traffic)
        return list(into)

    def _read_direct(
        self, url_ranges: list[tuple[str, int, int]], into: list[memoryview] | None
    ) -> list[Buffer]:
        """`read_ranges` without the cache. Ranges that follow each other in a file are read
        together: with one `preadv` into their buffers (local), or in one request (remote);
        each local file is opened once."""
        out: list[Buffer | None] = [None] * len(url_ranges)
        remote: list[int] = []
        local: dict[str, tuple[str, list[int]]] = {}
        where: dict[str, tuple[AbstractFileSystem, str]] = {}
        for i, (url, _, _) in enumerate(url_ranges):
            if url not in where:
                where[url] = self.fs(url)
            fs, path = where[url]
            if isinstance(fs, LocalFileSystem) and hasattr(os, "preadv"):
                local.setdefault(url, (path, []))[1].append(i)
            else:
                remote.append(i)
        for url, (path, index) in local.items():
            ranges = [(url_ranges[i][1], url_ranges[i][2]) for i in index]
            if into is not None:
                bufs = [into[i] for i in index]
            else:
                bufs = [memoryview(bytearray(end - start)) for start, end in ranges]
            _pread(url, path, ranges, bufs)
            for i, buf in zip(index, bufs, strict=True):
                out[i] = buf
        if remote:
            blobs = self._read_remote([url_ranges[i] for i in remote])
            for i, blob in zip(remote, blobs, strict=True):
                if into is not None:
                    into[i][:] = blob
                    blob = into[i]
                out[i] = blob
        return out  # type: ignore[return-value]

    def _read_remote(self, url_ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Requests of at most `REQUEST_BYTES`, a range that follows another in its file
        joining that one's request, then each range's bytes cut out of them."""
        requests: list[tuple[str, int, int]] = []
        cuts: list[list[tuple[int, int, int]]] = [[] for _ in url_ranges]
        for i in sorted(range(len(url_ranges)), key=url_ranges.__getitem__):
            url, pos, end = url_ranges[i]
            while pos < end:
                last = requests[-1] if requests else None
                if last and last[0] == url and last[2] == pos and pos - last[1] < REQUEST_BYTES:
                    stop = min(end, last[1] + REQUEST_BYTES)
                    requests[-1] = (url, last[1], stop)
                else:
                    stop = min(end, pos + REQUEST_BYTES)
                    requests.append((url, pos, stop))
                lo = requests[-1][1]
                cuts[i].append((len(requests) - 1, pos - lo, stop - lo))
                pos = stop
        blobs = self._fetch(requests)
        return [
            blobs[c[0][0]][c[0][1] : c[0][2]] if len(c) == 1
            else b"".join(blobs[r][lo:hi] for r, lo, hi in c)
            for c in cuts
        ]  # fmt: skip

    def _fetch(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """One batched `cat_ranges` per filesystem. A request that failed is raised as a
        `StorageError`, unless the failure is transient and its store's client retries
        nothing itself (`retried_here`): then it is tried again alone, with backoff."""
        out: list[bytes | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        for attempt in range(ATTEMPTS):
            errors: dict[int, BaseException] = {}
            groups: dict[int, tuple[AbstractFileSystem, list[int], list[str]]] = {}
            for i in todo:
                fs, path = self.fs(requests[i][0])
                groups.setdefault(id(fs), (fs, [], []))
                groups[id(fs)][1].append(i)
                groups[id(fs)][2].append(path)
            for fs, index, paths in groups.values():
                starts = [requests[i][1] for i in index]
                ends = [requests[i][2] for i in index]
                try:
                    blobs: list[Any] = fs.cat_ranges(paths, starts, ends, on_error="return")
                except Exception as e:  # noqa: BLE001  (the whole batch failed: each request reports it)
                    blobs = [e] * len(index)
                for i, blob in zip(index, blobs, strict=True):
                    url, start, end = requests[i]
                    if not isinstance(blob, BaseException) and len(blob) != end - start:
                        blob = ChangedError(f"short read of [{start}, {end}): {len(blob)} bytes")
                    if isinstance(blob, BaseException):
                        errors[i] = blob
                    else:
                        out[i] = blob
            if not errors:
                return out  # type: ignore[return-value]
            for i, e in errors.items():
                url = requests[i][0]
                again = backend_of(url).retried_here and transient(e)
                if not again or attempt == ATTEMPTS - 1:
                    raise storage_error(e, url, "read", "input") from e
            todo = sorted(errors)
            time.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")


def _pread(url: str, path: str, ranges: list[tuple[int, int]], bufs: list[memoryview]) -> None:
    """Bytes `[start, end)` of a local file into the buffer of each range (errors are
    permanent). The file is opened once; ranges that follow each other in it are read by
    one `preadv` into their buffers."""
    for (start, end), buf in zip(ranges, bufs, strict=True):
        if len(buf) != end - start:
            raise ValueError(f"buffer of {len(buf)} bytes for the range [{start}, {end})")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise storage_error(e, url, "read", "input") from e
    try:
        order = sorted(range(len(ranges)), key=ranges.__getitem__)
        k = 0
        while k < len(order):
            start, end = ranges[order[k]]
            run = [bufs[order[k]]]
            k += 1
            while k < len(order) and ranges[order[k]][0] == end:
                end = ranges[order[k]][1]
                run.append(bufs[order[k]])
                k += 1
            _preadv(fd, url, start, end, run)
    finally:
        os.close(fd)


def _preadv(fd: int, url: str, start: int, end: int, run: list[memoryview]) -> None:
    """Fill the buffers of `run`, which hold bytes `[start, end)` of the file in order."""
    pending = collections.deque(b for b in run if len(b))
    at = start
    while pending:
        batch, size = [], 0
        for buf in itertools.islice(pending, _IOV_MAX):
            if size + len(buf) > _PREAD_BYTES:
                if not batch:
                    batch, size = [buf[:_PREAD_BYTES]], _PREAD_BYTES
                break
            batch.append(buf)
            size += len(buf)
        try:
            n = os.preadv(fd, batch, at)
        except OSError as e:
            raise storage_error(e, url, "read", "input") from e
        if n == 0:
            short = ChangedError(f"short read of [{start}, {end}): {at - start} bytes")
            raise storage_error(short, url, "read", "input")
        at += n
        while n:
            if len(pending[0]) <= n:
                n -= len(pending.popleft())
            else:
                pending[0] = pending[0][n:]
                n = 0


#: Largest single `preadv` (Linux caps one call at about 2 GiB), and most buffers in one.
_PREAD_BYTES = 1 << 30
_IOV_MAX = 1024


def join(url: str, name: str) -> str:
    """Append a file name to a folder URL."""
    return url.rstrip("/") + "/" + name


def parse_storage_options(text: str | None) -> dict[str, dict[str, Any]]:
    """`--storage-options` JSON: an object mapping protocol to options."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RamDistError(f"--storage-options is not valid JSON ({e.msg})") from None
    Storage(value)
    return value
