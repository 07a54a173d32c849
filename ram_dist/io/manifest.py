"""The manifest in the output folder: what was merged, how, and which shards are finished.

It makes a merge resumable and checkable. A re-run of the same job reads it to skip the reduce
pass (its statistics are stored) and every finished shard; a re-run with other inputs or
parameters is refused, naming what changed; `ram-dist verify` re-hashes the shards against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ram_dist.errors import RamDistError
from ram_dist.io.json_files import MAX_MANIFEST_BYTES, read_json
from ram_dist.io.names import MANIFEST_NAME
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import write_json


@dataclass
class Manifest:
    """Mutable on the driver while the job runs; saved after each step."""

    identity: dict[str, Any]
    """Method, parameters, output dtype and every input file's identity."""
    shard_names: list[str]
    """Every shard the output will have, in order."""
    sharded: bool
    method_state: dict[str, Any] | None = None
    """The method's state after its reduce rounds (what it made of the summed statistics),
    once known; stored under the key "statistics"."""
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Finished shards: name -> {"size", "digest", "parts": [{"start", "stop", "sha256",
    "etag"?}]}; `digest` is the sha256 of the parts' sha256 digests (`sinks.shard_digest`).
    A manifest of format 1 has {"sha256", "size"}: the whole file's sha256."""
    writing: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Shards being written: name -> {"plan": [[start, stop], ...], "parts": {number:
    record}, and the store's handle, e.g. "upload_id"}, so a re-run resumes inside them."""
    complete: bool = False
    precision: dict[str, Any] | None = None
    """The first reduce round's precision check, as the report says it (`report.rounding`),
    kept with the statistics for a resumed run's report."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 2,
            "identity": self.identity,
            "shard_names": self.shard_names,
            "sharded": self.sharded,
            "statistics": self.method_state,
            "shards": self.shards,
            "writing": self.writing,
            "complete": self.complete,
            "precision": self.precision,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> Manifest:
        try:
            return cls(
                identity=raw["identity"],
                shard_names=list(raw["shard_names"]),
                sharded=bool(raw["sharded"]),
                method_state=raw.get("statistics"),
                shards=dict(raw.get("shards") or {}),
                writing=dict(raw.get("writing") or {}),
                complete=bool(raw.get("complete")),
                precision=raw.get("precision"),
            )
        except (KeyError, TypeError) as e:
            raise RamDistError(f"{where}: not a ram-dist manifest ({e})") from e


def load_manifest(out_url: str, storage: Storage) -> Manifest | None:
    """The manifest at `out_url`, or None when there is none; one larger than
    `MAX_MANIFEST_BYTES` is refused before it is read."""
    url = join(out_url, MANIFEST_NAME)
    try:
        raw = read_json(url, storage, MAX_MANIFEST_BYTES, "manifest", "output")
    except FileNotFoundError:
        return None
    if not isinstance(raw, dict):
        raise RamDistError(f"{url}: not a ram-dist manifest (not a JSON object)")
    return Manifest.from_json(raw, url)


def save_manifest(out_url: str, manifest: Manifest, storage: Storage) -> None:
    write_json(join(out_url, MANIFEST_NAME), manifest.to_json(), storage)


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between two job identities, in words a person can act on."""
    changes = []
    for key in ("method", "out_dtype", "formats", "measured_against"):
        if old.get(key) != new.get(key):
            changes.append(f"{key}: {old.get(key)} -> {new.get(key)}")
    old_params, new_params = old.get("parameters", {}), new.get("parameters", {})
    for key in sorted(set(old_params) | set(new_params)):
        if old_params.get(key) != new_params.get(key):
            changes.append(f"parameter {key}: {old_params.get(key)} -> {new_params.get(key)}")
    old_inputs, new_inputs = old.get("inputs", []), new.get("inputs", [])
    if len(old_inputs) != len(new_inputs):
        changes.append(f"number of inputs: {len(old_inputs)} -> {len(new_inputs)}")
    for was, now in zip(old_inputs, new_inputs, strict=False):
        label = now["role"]
        if was["location"] != now["location"]:
            changes.append(f"{label}: location {was['location']} -> {now['location']}")
            continue
        for name in sorted(set(was["files"]) | set(now["files"])):
            a, b = was["files"].get(name), now["files"].get(name)
            if a != b:
                what = "added" if a is None else "removed" if b is None else _what(a, b)
                changes.append(f"{label} ({now['location']}): file {name} {what}")
    return changes


def _what(a: dict[str, Any], b: dict[str, Any]) -> str:
    parts = [k for k in ("size", "header_sha256", "version") if a.get(k) != b.get(k)]
    return "changed (" + ", ".join(parts) + ")"
