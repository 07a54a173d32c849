"""Safetensors shard headers, files published atomically, and the index, written last.

The header of an output shard is known before any tensor is computed (names, dtypes and
shapes come from the base), so workers can write a shard's parts anywhere in it (`sinks`).
`AtomicFile` makes small files and streamed shards visible at their final name only when
every byte is written: a local file under a temporary name, then renamed; an object store
upload (a multipart upload on S3) completed only on commit and aborted on failure.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from types import TracebackType

from ram_dist.dtypes import itemsize
from ram_dist.io.failures import reported
from ram_dist.io.names import INDEX_NAME, PARTIAL_SUFFIX
from ram_dist.io.storage import Storage, join


class AtomicFile:
    """Bytes written here appear at `url` only on `commit()`; `discard()` leaves nothing.
    A failed write is a `StorageError` naming the output file."""

    def __init__(self, url: str, storage: Storage) -> None:
        self.url = url
        self.fs, self._path = storage.fs(url)
        self._local = storage.is_local(url)
        with reported(url, "write", "output"):
            if self._local:
                self._partial = self._path + PARTIAL_SUFFIX
                self.fs.makedirs(os.path.dirname(self._path), exist_ok=True)
                self._f = self.fs.open(self._partial, "wb")
            else:
                self._f = self.fs.open(self._path, "wb", autocommit=False)
        self.written = 0
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        with reported(self.url, "write", "output"):
            self._f.write(data)
        self.written += len(data)

    def commit(self) -> None:
        try:
            with reported(self.url, "write", "output"):
                self._f.close()
                if self._local:
                    self.fs.mv(self._partial, self._path)
                else:
                    self._f.commit()
        except BaseException:
            self.discard()
            raise
        self._done = True

    def discard(self) -> None:
        """Leave nothing, as far as the store lets us: this runs while another error is on
        its way out (a partial name left behind is never taken for a finished file)."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            if self._local:
                with contextlib.suppress(Exception):
                    self._f.close()  # a failed flush still closes the file
                if self.fs.exists(self._partial):
                    self.fs.rm(self._partial)
            else:
                try:
                    self._f.discard()  # aborts a multipart upload; the final key never appears
                finally:
                    self._f.closed = True  # nothing left to flush

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


@dataclass(frozen=True)
class OutTensor:
    """A tensor of an output shard, in the order its bytes are written."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def shard_header(tensors: list[OutTensor]) -> bytes:
    """The 8-byte length plus JSON header, padded with spaces to 8 bytes as safetensors does.

    The JSON is `json.dumps(header, separators=(",", ":"))` of `{"__metadata__": {"format":
    "pt"}, name: {"dtype", "shape", "data_offsets"}, ...}`, written entry by entry (a third of
    the time for a shard of 100k tensors; `tests/planning/test_many_small_tensors.py` checks
    the bytes against `json.dumps`)."""
    parts = ['{"__metadata__":{"format":"pt"}']
    offset = 0
    for t in tensors:
        end = offset + t.nbytes
        shape = ",".join(map(str, t.shape))
        parts.append(
            f',{_json(t.name)}:{{"dtype":{_json(t.dtype)},"shape":[{shape}],'
            f'"data_offsets":[{offset},{end}]}}'
        )
        offset = end
    parts.append("}")
    body = "".join(parts).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


_json = json.JSONEncoder(separators=(",", ":")).encode


def write_index(
    out_url: str, weight_map: dict[str, str], total_size: int, storage: Storage
) -> None:
    """Write `model.safetensors.index.json`, the last step of a merge."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(join(out_url, INDEX_NAME), index, storage)


def write_json(url: str, obj: object, storage: Storage) -> None:
    """Write JSON atomically (temporary name or uncommitted upload, then publish)."""
    with AtomicFile(url, storage) as f:
        f.write(json_text(obj).encode())


def json_text(obj: object) -> str:
    """Valid JSON, which has no infinity or NaN: such floats (rho of a task whose changes are
    all shared is infinite) are written as the strings "inf", "-inf" and "nan"."""
    return json.dumps(_finite(obj), indent=2, allow_nan=False) + "\n"


def _finite(obj: object) -> object:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
