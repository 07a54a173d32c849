"""Copy the base's non-weight files (config, tokenizer, chat template) into the output.

`config.json` is parsed (to name the output dtype) only within `MAX_CONFIG_BYTES`; the other
files are copied as bytes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from ram_dist.dtypes import FLOATING, dtype_name
from ram_dist.io.checkpoint import PICKLE_SUFFIXES
from ram_dist.io.failures import reported
from ram_dist.io.json_files import MAX_CONFIG_BYTES, checked_size
from ram_dist.io.names import CARD_NAME, INDEX_NAME, MODEL_CONFIG_NAME
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import AtomicFile

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".h5", ".msgpack", *PICKLE_SUFFIXES)
#: Not copied: the base's own model card describes the base, not the merge.
SKIPPED = frozenset({INDEX_NAME, CARD_NAME})


def non_weight_files(base_url: str, storage: Storage) -> list[str]:
    """Top-level files of the base folder that are not weights (names only)."""
    fs, path = storage.fs(base_url)
    names = []
    with reported(base_url, "list", "input"):
        entries = fs.ls(path, detail=True)
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") != "file" or name in SKIPPED or name.startswith("."):
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            continue
        names.append(name)
    return sorted(names)


def copy_files(
    base_url: str,
    out_url: str,
    names: list[str],
    storage: Storage,
    out_dtype: str | None = None,
    quantization: Mapping[str, Any] | None = None,
) -> int:
    """Copy files by name from the base folder to the output, whatever either's protocol.
    With `out_dtype` (a safetensors dtype every merged tensor is written in), config.json says
    so, as mergekit's does: `transformers` loads a model in the dtype it names (and a
    quantized base's quantization_config is dropped: no quantized tensor is left). Else, with
    `quantization`, config.json's quantization_config becomes it: what is left quantized."""
    src_fs, src = storage.fs(base_url)
    total = 0
    for name in names:
        url = join(base_url, name)
        rewrite = name == MODEL_CONFIG_NAME and (out_dtype in FLOATING or quantization is not None)
        if rewrite:  # parsed as JSON: refused over its cap before it is read
            checked_size(url, storage, MAX_CONFIG_BYTES, "config", "input")
        with reported(url, "read", "input"):
            data = src_fs.cat_file(join(src, name))
        if rewrite and out_dtype in FLOATING:
            data = _with_dtype(data, dtype_name(out_dtype))
        elif rewrite:
            data = _with_quantization(data, quantization)
        with AtomicFile(join(out_url, name), storage) as f:
            f.write(data)
        total += len(data)
    return total


def _with_dtype(data: bytes, name: str) -> bytes:
    """config.json with its dtype (`torch_dtype`, or `dtype` in newer transformers) set to
    `name`, and without the base's `quantization_config` (fine-grained FP8, MXFP4): every
    merged tensor, the quantized weights too, is written in that dtype, without scales.
    Unchanged if it is not a JSON object."""

    def edit(config: dict[str, Any]) -> None:
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
        config.update({k: name for k in keys})
        config.pop("quantization_config", None)

    return _edited(data, edit)


def _with_quantization(data: bytes, quantization: Mapping[str, Any] | None) -> bytes:
    """config.json with `quantization` as its quantization_config (unchanged if it is not a
    JSON object)."""
    return _edited(data, lambda config: config.update(quantization_config=dict(quantization or {})))


def _edited(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """config.json after `edit` changed it in place, written as the merge writes it (sorted
    keys, indent 2); unchanged if it is not a JSON object."""
    try:
        config = json.loads(data)
    except ValueError:
        return data
    if not isinstance(config, dict):
        return data
    edit(config)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
