"""A Hugging Face style checkpoint folder, known by its headers only.

The driver opens every input once to learn tensor names, dtypes, shapes and byte offsets;
workers then read exactly the byte ranges they need. Nothing here loads tensor data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ram_dist.errors import CheckpointError
from ram_dist.io.safetensors_header import (
    FileHeader,
    TensorInfo,
    header_length,
    parse_header,
)
from ram_dist.io.storage import Storage, join

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class Checkpoint:
    """Headers of one checkpoint: which file holds each tensor and where its bytes are."""

    url: str
    label: str
    files: tuple[str, ...]
    tensors: dict[str, TensorInfo]
    sharded: bool
    identity: dict[str, dict[str, object]]
    """Per file: size, sha256 of the header, and the store's version (ETag, blob id, mtime)."""

    def describe(self, name: str | None = None) -> str:
        """`label (url)` plus the file that holds `name`, for error messages."""
        text = f"{self.label} ({self.url})"
        if name is not None and name in self.tensors:
            text += f", file {self.tensors[name].file}"
        return text


#: Keys of `fs.info()` that change when a file's content changes, by store.
VERSION_KEYS = ("ETag", "etag", "blob_id", "md5Hash", "generation", "mtime")


def file_version(info: dict[str, object]) -> str | None:
    """What the store says identifies this version of a file (None if it says nothing)."""
    for key in VERSION_KEYS:
        if info.get(key) is not None:
            return f"{key}:{info[key]}"
    return None


def read_file_header(url: str, storage: Storage) -> tuple[FileHeader, dict[str, object]]:
    """Read and parse one safetensors header (two small reads, never the tensor data) and
    the file's identity."""
    fs, path = storage.fs(url)
    try:
        info = fs.info(path)
        size = int(info["size"])
        prefix = fs.cat_file(path, start=0, end=8)
        n = header_length(prefix, url, size)
        body = fs.cat_file(path, start=8, end=8 + n)
    except FileNotFoundError as e:
        raise CheckpointError(f"{url}: file not found") from e
    except OSError as e:
        raise CheckpointError(f"{url}: cannot read header ({e})") from e
    if len(body) != n:
        raise CheckpointError(f"{url}: header is truncated")
    header = parse_header(body, url, size)
    identity = {"size": size, "header_sha256": header.header_sha256, "version": file_version(info)}
    return header, identity


def open_checkpoint(url: str, label: str, storage: Storage) -> Checkpoint:
    """List a checkpoint folder, read its index (if sharded) and every shard header."""
    if url.rstrip("/").endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{label} ({url}) is a pickle checkpoint, which ram-dist never opens (loading one "
            "can run arbitrary code): convert it to safetensors first, e.g. "
            "`model.save_pretrained(dir, safe_serialization=True)` in transformers"
        )
    fs, path = storage.fs(url)
    try:
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointError(f"{label}: no checkpoint folder at {url}") from e
    weight_map: dict[str, str] | None = None
    if INDEX_NAME in names:
        weight_map = _read_weight_map(join(url, INDEX_NAME), label, storage)
        files = tuple(dict.fromkeys(weight_map.values()))
    elif SINGLE_NAME in names:
        files = (SINGLE_NAME,)
    else:
        pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
        hint = (
            f" It holds pickle weights ({', '.join(pickles)}), which ram-dist never opens: "
            "convert them to safetensors first (e.g. `model.save_pretrained(dir, "
            "safe_serialization=True)` in transformers)."
            if pickles
            else ""
        )
        raise CheckpointError(f"{label} ({url}): no {SINGLE_NAME} or {INDEX_NAME} found.{hint}")
    tensors: dict[str, TensorInfo] = {}
    identity: dict[str, dict[str, object]] = {}
    for file in files:
        if "/" in file or "\\" in file or ":" in file or file in ("", ".", ".."):
            raise CheckpointError(
                f"{label} ({url}): the index names file {file!r}, which is not a plain file "
                "name in the checkpoint folder (a path or URL there is refused)"
            )
        if file not in names:
            raise CheckpointError(
                f"{label} ({url}): the index names shard {file}, which does not exist"
            )
        header, identity[file] = read_file_header(join(url, file), storage)
        for name, info in header.tensors.items():
            if name in tensors:
                raise CheckpointError(
                    f"{label} ({url}): tensor {name!r} appears in both "
                    f"{tensors[name].file} and {info.file}"
                )
            if weight_map is not None and weight_map.get(name) != file:
                raise CheckpointError(
                    f"{label} ({url}): tensor {name!r} is in {info.file} but the index maps "
                    f"it to {weight_map.get(name)!r}"
                )
            tensors[name] = info
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(
                f"{label} ({url}): the index maps {missing[0]!r} to "
                f"{weight_map[missing[0]]} but that file has no such tensor"
            )
    return Checkpoint(
        url=url,
        label=label,
        files=files,
        tensors=tensors,
        sharded=weight_map is not None,
        identity=identity,
    )


def _read_weight_map(index_url: str, label: str, storage: Storage) -> dict[str, str]:
    fs, path = storage.fs(index_url)
    try:
        index = json.loads(fs.cat_file(path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{label}: cannot read index {index_url} ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{label}: {index_url} has no valid weight_map")
    return weight_map
