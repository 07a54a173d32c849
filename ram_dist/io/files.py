"""Copy the base's non-weight files (config, tokenizer, chat template) into the output."""

from __future__ import annotations

from ram_dist.io.checkpoint import INDEX_NAME, PICKLE_SUFFIXES
from ram_dist.io.storage import join, url_to_fs

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".h5", ".msgpack", *PICKLE_SUFFIXES)
#: Not copied: the base's own model card describes the base, not the merge.
SKIPPED = frozenset({INDEX_NAME, "README.md"})


def non_weight_files(base_url: str) -> list[str]:
    """Top-level files of the base folder that are not weights (names only)."""
    fs, path = url_to_fs(base_url)
    names = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") != "file" or name in SKIPPED or name.startswith("."):
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            continue
        names.append(name)
    return sorted(names)


def copy_files(base_url: str, out_url: str, names: list[str]) -> int:
    """Copy files by name from the base folder to the output; returns the bytes copied."""
    src_fs, src = url_to_fs(base_url)
    dst_fs, dst = url_to_fs(out_url)
    total = 0
    for name in names:
        data = src_fs.cat_file(join(src, name))
        with dst_fs.open(join(dst, name), "wb") as f:
            f.write(data)
        total += len(data)
    return total
