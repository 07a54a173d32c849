"""Parse a safetensors header without reading the tensors.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then raw
tensor data. Workers read rows as byte ranges, so the driver needs only the header: where
each tensor's bytes start, its dtype and its shape.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass

from ram_dist.dtypes import ITEMSIZE, itemsize
from ram_dist.errors import CheckpointError

#: A header larger than this is refused before it is read (a header bomb).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one file: where its bytes lie (absolute offsets in the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


@dataclass(frozen=True)
class FileHeader:
    """The parsed header of one safetensors file."""

    file: str
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_sha256: str = ""


def header_length(prefix: bytes, file: str, file_size: int | None) -> int:
    """Decode and bound-check the 8-byte length prefix."""
    if len(prefix) < 8:
        raise CheckpointError(f"{file}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{file}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap; "
            "the file is corrupt or hostile"
        )
    if file_size is not None and 8 + n > file_size:
        raise CheckpointError(
            f"{file}: header length {n} runs past the end of the file ({file_size} bytes); "
            "the file is truncated or not safetensors"
        )
    return n


def parse_header(header_json: bytes, file: str, file_size: int | None) -> FileHeader:
    """Validate the JSON header and turn it into `TensorInfo`s with absolute offsets."""
    data_start = 8 + len(header_json)
    try:
        raw = json.loads(header_json.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file}: header is not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: header JSON is nested too deeply") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: header JSON is not an object")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: __metadata__ is not an object of strings")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in raw.items():
        info = _well_formed(name, entry, file, data_start)
        if info is None:  # something is wrong with it: say what
            info = _tensor_info(name, entry, file, data_start)
        tensors[name] = info
        spans.append((info.start, info.end, name))
    spans.sort()
    pos = data_start
    for start, end, name in spans:
        if start < pos:
            raise CheckpointError(f"{file}: tensor {name!r} overlaps the previous tensor")
        if start > pos:
            raise CheckpointError(
                f"{file}: bytes {pos - data_start}..{start - data_start} of the data belong to "
                f"no tensor (before {name!r}); safetensors forbids gaps"
            )
        pos = end
    if file_size is not None and pos > file_size:
        raise CheckpointError(
            f"{file}: tensor data ends at byte {pos} but the file has {file_size} bytes; "
            "the file is truncated"
        )
    if file_size is not None and pos < file_size:
        raise CheckpointError(
            f"{file}: {file_size - pos} bytes after the last tensor belong to no tensor; "
            "safetensors forbids them"
        )
    return FileHeader(
        file=file,
        data_start=data_start,
        tensors=tensors,
        metadata=metadata,
        header_sha256=hashlib.sha256(header_json).hexdigest(),
    )


def _well_formed(name: str, entry: object, file: str, data_start: int) -> TensorInfo | None:
    """The `TensorInfo` of an entry that passes every check of `_tensor_info`, tested the
    quick way (exact JSON types); None for any other entry, which `_tensor_info` then refuses
    (or accepts, with the same result). A header holds one entry per tensor: 368k of them
    for DeepSeek-V3's base and three tasks."""
    if type(entry) is not dict:
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
        return None
    size = ITEMSIZE.get(dtype)
    if size is None or len(offsets) != 2:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        return None
    for s in shape:
        if type(s) is not int or s < 0:
            return None
    if end - begin != math.prod(shape) * size:
        return None
    return TensorInfo(name, dtype, tuple(shape), file, data_start + begin, data_start + end)


def _tensor_info(name: str, entry: object, file: str, data_start: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    expected = math.prod(shape) * itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(
            f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes but "
            f"{dtype} x {shape} needs {expected}"
        )
    return TensorInfo(
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        file=file,
        start=data_start + offsets[0],
        end=data_start + offsets[1],
    )
