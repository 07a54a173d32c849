"""Write safetensors shards as a stream, publish them atomically, write the index last.

The header of an output shard is known before any tensor is computed (names, dtypes and
shapes come from the base), so a shard is written front to back: header, then each work
unit's bytes in order. It goes to a temporary name and is moved into place only when every
byte has been written, so a reader never sees half a shard.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ram_dist.dtypes import itemsize
from ram_dist.io.checkpoint import INDEX_NAME
from ram_dist.io.storage import join, url_to_fs

PARTIAL_SUFFIX = ".ram-dist-partial"


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
    """The 8-byte length plus JSON header, padded with spaces to 8 bytes as safetensors does."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


class ShardWriter:
    """Runs on the driver: streams one output shard to a temporary name, then publishes it."""

    def __init__(self, out_url: str, file_name: str, tensors: list[OutTensor]) -> None:
        self.final_url = join(out_url, file_name)
        self.partial_url = self.final_url + PARTIAL_SUFFIX
        self.fs, self._partial_path = url_to_fs(self.partial_url)
        self._final_path = url_to_fs(self.final_url)[1]
        header = shard_header(tensors)
        self.expected = len(header) + sum(t.nbytes for t in tensors)
        self._f = self.fs.open(self._partial_path, "wb")
        self._f.write(header)
        self.written = len(header)

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self.written += len(data)

    def commit(self) -> None:
        """Close and move into place; refuses a shard whose size is not what its header says."""
        self._f.close()
        if self.written != self.expected:
            self.discard()
            raise RuntimeError(
                f"{self.final_url}: wrote {self.written} bytes, expected {self.expected}"
            )
        self.fs.mv(self._partial_path, self._final_path)

    def discard(self) -> None:
        """Drop the partial file after a failure; never touches the final name."""
        if not self._f.closed:
            self._f.close()
        if self.fs.exists(self._partial_path):
            self.fs.rm(self._partial_path)


def write_index(out_url: str, weight_map: dict[str, str], total_size: int) -> None:
    """Write `model.safetensors.index.json` (through a temporary name), the last step."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(join(out_url, INDEX_NAME), index)


def write_json_atomic(url: str, obj: object) -> None:
    """Write JSON to a temporary name, then move it into place."""
    fs, path = url_to_fs(url)
    with fs.open(path + PARTIAL_SUFFIX, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    fs.mv(path + PARTIAL_SUFFIX, path)
