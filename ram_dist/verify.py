"""`ram-dist verify OUT`: re-hash every shard against the manifest and check the index.

Reads only the output location. Returns the problems found, each naming the shard or file,
so that a scheduler can refuse to publish a damaged model.
"""

from __future__ import annotations

import hashlib
import json

from ram_dist.io.checkpoint import INDEX_NAME
from ram_dist.io.locations import resolve_output
from ram_dist.io.manifest import MANIFEST_NAME, load_manifest
from ram_dist.io.storage import Storage, join

READ_BYTES = 16 * 2**20


def verify(out: str, storage: Storage) -> tuple[list[str], int]:
    """(problems, shards checked). No problems means every shard hashes as recorded."""
    out = resolve_output(out)
    manifest = load_manifest(out, storage)
    if manifest is None:
        return [f"{join(out, MANIFEST_NAME)}: missing; not a ram-dist output"], 0
    fs, path = storage.fs(out)
    problems = []
    if not manifest.complete:
        problems.append(f"{out}: the merge did not finish (manifest not complete)")
    checked = 0
    for name in manifest.shard_names:
        shard_path = join(path, name)
        recorded = manifest.shards.get(name)
        if not fs.exists(shard_path):
            problems.append(f"shard {name}: missing")
            continue
        if recorded is None:
            problems.append(f"shard {name}: not recorded as finished in the manifest")
            continue
        digest, size = _sha256(fs, shard_path)
        checked += 1
        if size != recorded["size"] or digest != recorded["sha256"]:
            problems.append(
                f"shard {name}: sha256 {digest} ({size} bytes) does not match the manifest's "
                f"{recorded['sha256']} ({recorded['size']} bytes)"
            )
    if manifest.sharded:
        problems += _check_index(fs, join(path, INDEX_NAME), set(manifest.shard_names))
    return problems, checked


def _sha256(fs, path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _check_index(fs, index_path: str, shards: set[str]) -> list[str]:
    if not fs.exists(index_path):
        return [f"{INDEX_NAME}: missing"]
    try:
        weight_map = json.loads(fs.cat_file(index_path))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{INDEX_NAME}: unreadable ({e})"]
    named = set(weight_map.values())
    problems = [
        f"{INDEX_NAME}: names shard {s}, which the manifest does not" for s in named - shards
    ]
    problems += [f"{INDEX_NAME}: maps no tensor to shard {s}" for s in shards - named]
    return problems
