"""A Hugging Face style checkpoint folder, known by its headers only.

The driver opens every input once to learn tensor names, dtypes, shapes and byte offsets;
workers then read exactly the byte ranges they need. Nothing here loads tensor data.

Opening is a handful of round trips however many files there are: one listing per folder
(which gives every file's size and version), one index read per checkpoint, then the headers
of all files of all checkpoints read together (`header_reads`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ram_dist.errors import CheckpointError, RamDistError, StorageError
from ram_dist.io.failures import classify, is_storage_failure, storage_error
from ram_dist.io.header_reads import read_headers
from ram_dist.io.json_files import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, read_json
from ram_dist.io.names import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_PICKLE_NAME,
    ADAPTER_WEIGHTS_NAME,
    INDEX_NAME,
    MODEL_CONFIG_NAME,
    SINGLE_NAME,
)
from ram_dist.io.safetensors_header import FileHeader, TensorInfo
from ram_dist.io.storage import Storage, join

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
    quantization: dict[str, Any] | None = None
    """`quantization_config` of the folder's `config.json` (None: no such key, or no file)."""
    ties_embeddings: bool = False
    """Whether the folder's `config.json` sets `tie_word_embeddings` to true (the lm_head is
    the embedding matrix, not a tensor of its own); False without the key or the file."""
    adapter: dict[str, Any] | None = None
    """A PEFT adapter folder's `adapter_config.json` (`planning.adapters` reads it); None for
    a checkpoint of whole tensors. An adapter's `tensors` are the adapter's own."""
    model_config: dict[str, Any] | None = None
    """The folder's `config.json` (None: no such file): what an adapter's base is checked
    against."""

    def describe(self, name: str | None = None) -> str:
        """`label (url)` plus the file that holds `name`, for error messages."""
        text = f"{self.label} ({self.url})"
        if name is not None and name in self.tensors:
            text += f", file {self.tensors[name].file}"
        return text


def open_checkpoints(inputs: Sequence[tuple[str, str]], storage: Storage) -> list[Checkpoint]:
    """Open checkpoints given as `(url, label)`: each folder is listed and its index read, in
    order, then the headers of every file of every checkpoint are read in one batch, and each
    checkpoint is checked against its index. Errors come in the order of `inputs`."""
    folders = [_list_folder(url, label, storage) for url, label in inputs]
    urls = [join(f.url, file) for f in folders for file in f.files]
    listed = [f.listed[file] for f in folders for file in f.files]
    results = read_headers(urls, storage, listed)
    checkpoints, at = [], 0
    for folder in folders:
        checkpoints.append(_assemble(folder, results[at : at + len(folder.files)]))
        at += len(folder.files)
    return checkpoints


@dataclass(frozen=True)
class _Folder:
    """A listed checkpoint folder, its index read and checked: what `_assemble` needs."""

    url: str
    label: str
    files: tuple[str, ...]
    weight_map: dict[str, str] | None
    listed: dict[str, Mapping[str, Any]]
    """The listing's entry of each file in the folder, by file name."""
    quantization: dict[str, Any] | None
    ties_embeddings: bool
    adapter: dict[str, Any] | None = None
    model_config: dict[str, Any] | None = None


def _list_folder(url: str, label: str, storage: Storage) -> _Folder:
    if url.rstrip("/").endswith(PICKLE_SUFFIXES):
        raise CheckpointError(
            f"{label} ({url}) is a pickle checkpoint, which ram-dist never opens (loading one "
            "can run arbitrary code): convert it to safetensors first, e.g. "
            "`model.save_pretrained(dir, safe_serialization=True)` in transformers"
        )
    fs, path = storage.fs(url)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError) as e:
        if classify(e).root is not None:  # the bucket, not the folder: a URL to fix
            raise StorageError(f"{label}: {storage_error(e, url, 'list', 'input')}") from e
        raise CheckpointError(f"{label}: no checkpoint folder at {url}") from e
    except Exception as e:
        if is_storage_failure(e):
            err = storage_error(e, url, "list", "input")
            raise StorageError(f"{label}: {err}", err.exit_status) from e
        raise
    listed = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
    weight_map: dict[str, str] | None = None
    if ADAPTER_CONFIG_NAME in listed and not {INDEX_NAME, SINGLE_NAME} & set(listed):
        return _adapter_folder(url, label, storage, listed)
    if INDEX_NAME in listed:
        weight_map = _read_weight_map(join(url, INDEX_NAME), label, storage, listed[INDEX_NAME])
        files = tuple(dict.fromkeys(weight_map.values()))
    elif SINGLE_NAME in listed:
        files = (SINGLE_NAME,)
    else:
        pickles = sorted(n for n in listed if n.endswith(PICKLE_SUFFIXES))
        hint = (
            f" It holds pickle weights ({', '.join(pickles)}), which ram-dist never opens: "
            "convert them to safetensors first (e.g. `model.save_pretrained(dir, "
            "safe_serialization=True)` in transformers)."
            if pickles
            else ""
        )
        raise CheckpointError(f"{label} ({url}): no {SINGLE_NAME} or {INDEX_NAME} found.{hint}")
    for file in files:
        if "/" in file or "\\" in file or ":" in file or file in ("", ".", ".."):
            raise CheckpointError(
                f"{label} ({url}): the index names file {file!r}, which is not a plain file "
                "name in the checkpoint folder (a path or URL there is refused)"
            )
        if file not in listed:
            raise CheckpointError(
                f"{label} ({url}): the index names shard {file}, which does not exist"
            )
    config = _read_json_object(url, MODEL_CONFIG_NAME, label, storage, listed)
    quantization, ties = _weights_config(config, label, join(url, MODEL_CONFIG_NAME))
    return _Folder(url, label, files, weight_map, listed, quantization, ties, None, config)


def _adapter_folder(
    url: str, label: str, storage: Storage, listed: dict[str, Mapping[str, Any]]
) -> _Folder:
    """A PEFT adapter folder: its config, and its weights in safetensors (a pickle only is
    refused by name, never opened)."""
    if ADAPTER_WEIGHTS_NAME not in listed:
        held = (
            f"its weights only as {ADAPTER_PICKLE_NAME}, a pickle, which ram-dist never opens "
            "(loading one can run arbitrary code): save the adapter again with "
            "`model.save_pretrained(dir)` (safetensors is PEFT's default)"
            if ADAPTER_PICKLE_NAME in listed
            else f"no {ADAPTER_WEIGHTS_NAME}: save the adapter with `model.save_pretrained(dir)`"
        )
        raise CheckpointError(f"{label} ({url}) is a PEFT adapter folder with {held}")
    config = _read_json_object(url, ADAPTER_CONFIG_NAME, label, storage, listed)
    if config is None:
        raise CheckpointError(
            f"{label} ({url}): {ADAPTER_CONFIG_NAME} is not a JSON object; save the adapter "
            "with PEFT's `save_pretrained`"
        )
    files = (ADAPTER_WEIGHTS_NAME,)
    return _Folder(url, label, files, None, listed, None, False, config, None)


def _assemble(
    folder: _Folder, results: list[tuple[FileHeader, dict[str, object]] | BaseException]
) -> Checkpoint:
    """The checkpoint from its files' headers, checked against each other and the index."""
    url, label, weight_map = folder.url, folder.label, folder.weight_map
    tensors: dict[str, TensorInfo] = {}
    identity: dict[str, dict[str, object]] = {}
    for file, result in zip(folder.files, results, strict=True):
        if isinstance(result, BaseException):
            raise result
        header, identity[file] = result
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
    # Every tensor is in the index (checked above): one the index maps is missing exactly
    # when the index holds more names.
    if weight_map is not None and len(weight_map) != len(tensors):
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(
                f"{label} ({url}): the index maps {missing[0]!r} to "
                f"{weight_map[missing[0]]} but that file has no such tensor"
            )
    return Checkpoint(
        url=url,
        label=label,
        files=folder.files,
        tensors=tensors,
        sharded=weight_map is not None,
        identity=identity,
        quantization=folder.quantization,
        ties_embeddings=folder.ties_embeddings,
        adapter=folder.adapter,
        model_config=folder.model_config,
    )


def trained_on_config(named: Any, base_url: str, storage: Storage) -> dict[str, Any] | None:
    """The config.json of the model an adapter names as its base (`base_model_name_or_path`)
    where it is a folder on this machine other than the base, else None: a Hub id is not
    fetched (no network is assumed), and an unreadable one is not an error, only a check
    left undone."""
    if not isinstance(named, str) or not named or "://" in named:
        return None
    if not os.path.isdir(named) or os.path.realpath(named) == os.path.realpath(base_url):
        return None
    try:
        config = read_json(
            os.path.join(named, MODEL_CONFIG_NAME), storage, MAX_CONFIG_BYTES, "config", "input"
        )
    except (OSError, RamDistError):
        return None
    return config if isinstance(config, dict) else None


def _read_json_object(
    url: str, name: str, label: str, storage: Storage, listed: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any] | None:
    """A small JSON file of the folder (None when it is not listed, or not an object)."""
    entry = listed.get(name)
    if entry is None:
        return None
    size = entry.get("size")
    known = size if isinstance(size, int) and not entry.get("islink") else None
    try:
        config = read_json(join(url, name), storage, MAX_CONFIG_BYTES, "config", "input", known)
    except FileNotFoundError:
        return None
    except StorageError as e:
        raise StorageError(f"{label}: {e}", e.exit_status) from e
    except RamDistError as e:
        raise CheckpointError(f"{label}: {e}") from e
    return config if isinstance(config, dict) else None


def _weights_config(
    config: dict[str, Any] | None, label: str, config_url: str
) -> tuple[dict[str, Any] | None, bool]:
    """What config.json says of the weights: its `quantization_config`, which says how they
    are stored (`planning.formats`; None without it), and whether `tie_word_embeddings` is
    true (`planning.layout` names a tied lm_head a task wrote out)."""
    if config is None:
        return None, False
    ties = config.get("tie_word_embeddings") is True
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise CheckpointError(f"{label}: {config_url} has a quantization_config that is not "
                              "an object")  # fmt: skip
    return quant, ties


def _read_weight_map(
    index_url: str, label: str, storage: Storage, entry: Mapping[str, Any]
) -> dict[str, str]:
    """The index's `weight_map`, in one GET: a read of the listed size is a ranged request,
    where s3fs would first ask the size of a whole-file read (a HEAD request). An index
    larger than `MAX_INDEX_BYTES` is refused before it is read."""
    size = entry.get("size")
    listed = size if isinstance(size, int) and not entry.get("islink") else None
    try:
        index = read_json(index_url, storage, MAX_INDEX_BYTES, "index", "input", listed)
    except FileNotFoundError as e:
        raise CheckpointError(f"{label}: cannot read index {index_url} ({e})") from e
    except StorageError as e:
        raise StorageError(f"{label}: {e}", e.exit_status) from e
    except RamDistError as e:
        raise CheckpointError(f"{label}: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{label}: {index_url} has no valid weight_map")
    return weight_map
