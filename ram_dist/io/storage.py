"""The few fsspec calls ram-dist needs, with URLs kept as strings (pathlib mangles `s3://`)."""

from __future__ import annotations

import functools

import fsspec
from fsspec import AbstractFileSystem


@functools.lru_cache(maxsize=64)
def _cached_fs(protocol_url: str) -> tuple[AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(protocol_url)


def url_to_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """The filesystem and the path inside it for a URL or local path (cached per process)."""
    return _cached_fs(url)


def join(url: str, name: str) -> str:
    """Append a file name to a folder URL."""
    return url.rstrip("/") + "/" + name


def read_ranges(url_ranges: list[tuple[str, int, int]]) -> list[bytes]:
    """Read byte ranges `[start, end)` of files, one batched call per filesystem.

    Empty ranges read nothing.
    """
    out: list[bytes] = [b""] * len(url_ranges)
    groups: dict[int, tuple[AbstractFileSystem, list[int], list[str]]] = {}
    for i, (url, start, end) in enumerate(url_ranges):
        if end > start:
            fs, path = url_to_fs(url)
            groups.setdefault(id(fs), (fs, [], []))
            groups[id(fs)][1].append(i)
            groups[id(fs)][2].append(path)
    for fs, wanted, paths in groups.values():
        starts = [url_ranges[i][1] for i in wanted]
        ends = [url_ranges[i][2] for i in wanted]
        for i, blob in zip(wanted, fs.cat_ranges(paths, starts, ends), strict=True):
            url, start, end = url_ranges[i]
            if isinstance(blob, Exception):
                raise blob
            if len(blob) != end - start:
                raise OSError(f"{url}: short read of bytes [{start}, {end}): got {len(blob)}")
            out[i] = blob
    return out
