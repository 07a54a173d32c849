"""`ram-dist verify OUT`: re-hash every shard against the manifest and check the index.

A shard's digest is defined from its parts (the sha256 of their sha256 digests, in order, as
S3 defines a multipart object's composite checksum), so each part is re-hashed and checked.

Reads only the output location. Returns the problems found, each naming the shard or file,
so that a scheduler can refuse to publish a damaged model.
"""

from __future__ import annotations

import hashlib

from ram_dist.errors import RamDistError, StorageError
from ram_dist.io.json_files import MAX_INDEX_BYTES, read_json
from ram_dist.io.locations import resolve_output
from ram_dist.io.manifest import load_manifest
from ram_dist.io.names import INDEX_NAME, MANIFEST_NAME
from ram_dist.io.sinks import shard_digest
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
        checked += 1
        problems += _check_shard(fs, shard_path, name, recorded)
    if manifest.sharded:
        problems += _check_index(join(out, INDEX_NAME), storage, set(manifest.shard_names))
    return problems, checked


def _check_shard(fs, path: str, name: str, recorded: dict) -> list[str]:
    """Re-hash a shard: part by part against its recorded part digests and the shard digest
    defined from them, or (a manifest of format 1) as one sha256 of the whole file."""
    size = fs.size(path)
    if size != recorded["size"]:
        return [f"shard {name}: {size} bytes, the manifest says {recorded['size']}"]
    if "parts" not in recorded:
        digest = _sha256(fs, path, 0, size)
        if digest != recorded["sha256"]:
            return [f"shard {name}: sha256 {digest} does not match the manifest's "
                    f"{recorded['sha256']}"]  # fmt: skip
        return []
    parts, problems, at = recorded["parts"], [], 0
    for number, part in enumerate(parts, 1):
        if part["start"] != at:
            return [f"shard {name}: the manifest's parts do not cover it (part {number})"]
        digest = _sha256(fs, path, part["start"], part["stop"])
        if digest != part["sha256"]:
            problems.append(
                f"shard {name}: part {number} (bytes {part['start']} to {part['stop']}) has "
                f"sha256 {digest}; the manifest says {part['sha256']}"
            )
        at = part["stop"]
    if at != size:
        problems.append(f"shard {name}: the manifest's parts end at {at}, the file at {size}")
    whole = shard_digest([p["sha256"] for p in parts])
    if whole != recorded["digest"]:
        problems.append(f"shard {name}: digest {whole} from its parts does not match the "
                        f"manifest's {recorded['digest']}")  # fmt: skip
    return problems


def _sha256(fs, path: str, start: int, stop: int) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0 and (block := f.read(min(READ_BYTES, left))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _check_index(index_url: str, storage: Storage, shards: set[str]) -> list[str]:
    try:
        index = read_json(index_url, storage, MAX_INDEX_BYTES, "index", "output")
        weight_map = index["weight_map"]
        named = set(weight_map.values())
    except FileNotFoundError:
        return [f"{INDEX_NAME}: missing"]
    except StorageError:
        raise
    except (RamDistError, KeyError, TypeError, AttributeError) as e:
        return [f"{INDEX_NAME}: unreadable ({e})"]
    problems = [
        f"{INDEX_NAME}: names shard {s}, which the manifest does not" for s in named - shards
    ]
    problems += [f"{INDEX_NAME}: maps no tensor to shard {s}" for s in shards - named]
    return problems
