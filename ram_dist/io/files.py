"""Copy the base's non-weight files (config, tokenizer, chat template) into the output."""

from __future__ import annotations

from ram_dist.io.checkpoint import INDEX_NAME, PICKLE_SUFFIXES
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import AtomicFile

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".h5", ".msgpack", *PICKLE_SUFFIXES)
#: Not copied: the base's own model card describes the base, not the merge.
SKIPPED = frozenset({INDEX_NAME, "README.md"})


def non_weight_files(base_url: str, storage: Storage) -> list[str]:
    """Top-level files of the base folder that are not weights (names only)."""
    fs, path = storage.fs(base_url)
    names = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") != "file" or name in SKIPPED or name.startswith("."):
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            continue
        names.append(name)
    return sorted(names)


def copy_files(base_url: str, out_url: str, names: list[str], storage: Storage) -> int:
    """Copy files by name from the base folder to the output, whatever either's protocol."""
    src_fs, src = storage.fs(base_url)
    total = 0
    for name in names:
        data = src_fs.cat_file(join(src, name))
        with AtomicFile(join(out_url, name), storage) as f:
            f.write(data)
        total += len(data)
    return total
