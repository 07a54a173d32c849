"""GCS: each worker uploads its part as an object of its own under the output's hidden
`PARTS_DIR`; the driver composes a shard's parts into the shard (composites of composites
past `MAX_COMPOSE_SOURCES`), then deletes them.

A shard's parts live at `<output>/.ram-dist-parts/<shard>/<upload id>/<part number, 5
digits>.ram-dist-part`, its intermediate composites beside them (`c<level>-<index>...`): a
prefix, and a suffix, a bucket's lifecycle rule can clear of what a crashed run left.

Each compose names every source at the generation its upload returned, and the final one
the shard's name at the generation seen when the shard was opened (0: none), so bytes that
changed since, or a shard another run wrote meanwhile, make it fail instead of being
published.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec.asyn import sync

from ram_dist.errors import RamDistError
from ram_dist.io import gcs
from ram_dist.io.failures import conditional, reported
from ram_dist.io.sinks.base import OpenShard, OutputSink, Part, PartReceipt, StoreTarget, kept_parts
from ram_dist.io.storage import join

#: The hidden folder of an output that holds the parts of shards being written.
PARTS_DIR = ".ram-dist-parts"
#: How every part object's name ends (a lifecycle rule may match it, bucket-wide).
PART_SUFFIX = ".ram-dist-part"
#: The custom metadata key a composed shard carries: the upload it was made from.
UPLOAD_KEY = "ram-dist-upload"


def part_name(prefix: str, number: int) -> str:
    return f"{prefix}{number:05d}{PART_SUFFIX}"


def etag(answer: dict[str, Any]) -> str:
    """How the manifest records an uploaded part: its generation and CRC32C."""
    return f"{answer['generation']}/{answer['crc32c']}"


@dataclass(frozen=True)
class GcsTarget(StoreTarget):
    """The prefix a shard's parts go to; each task uploads the part it computed."""

    bucket: str
    prefix: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        fs = self.fs()
        body = data.tobytes()
        with reported(self.url, "write", "output"):
            answer = sync(fs.loop, gcs.upload, fs, self.bucket, part_name(self.prefix, part.number),
                          body)  # fmt: skip
        return PartReceipt.of(part, sha256.hex(), etag(answer))


class GcsSink(OutputSink):
    """Parts uploaded by the workers as objects, composed into each shard by the driver."""

    min_part_bytes = 256 * 2**10
    """GCS composes objects of any size; parts of at least 256 KiB (its upload chunk) keep
    the requests per shard few while a small shard still has several parts."""

    chosen = "GCS: workers upload each part as an object, the driver composes them into the shard"

    def _run(self, coro: Any, *args: Any, **kwargs: Any) -> Any:
        fs, _ = self.storage.fs(self.out_url)
        return sync(fs.loop, coro, fs, *args, **kwargs)

    def _where(self, shard: str) -> tuple[str, str, str, str]:
        """The shard's URL, bucket and key, and the key prefix of its parts' folder."""
        url = join(self.out_url, shard)
        fs, path = self.storage.fs(url)
        bucket, key, _ = fs.split_path(path)
        out_key = fs.split_path(self.storage.fs(self.out_url)[1])[1].rstrip("/")
        parts = f"{out_key}/{PARTS_DIR}/{shard}/" if out_key else f"{PARTS_DIR}/{shard}/"
        return url, bucket, key, parts

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        url, bucket, key, parts = self._where(shard)
        kept = kept_parts(plan, old) or {}
        upload_id = (old or {}).get("upload_id") if kept else None
        upload_id = upload_id or uuid.uuid4().hex
        prefix = f"{parts}{upload_id}/"
        with reported(url, "write", "output"):
            listed = {o["name"]: o for o in self._run(gcs.listing, bucket, parts)}
            there = self._run(gcs.stat, bucket, key)
            # What other runs left for this shard (another upload, another plan) goes now.
            self._run(gcs.delete_all, bucket, [n for n in listed if not n.startswith(prefix)])
        done = {}
        for part in plan:
            # A part the manifest recorded is reused where the store still holds that very
            # upload of it: the same size, generation and CRC32C (which the store checked
            # against the bytes when they were uploaded).
            rec, obj = kept.get(part.number), listed.get(part_name(prefix, part.number))
            if rec is None or obj is None or int(obj["size"]) != part.size:
                continue
            if rec.get("etag") == etag(obj):
                done[part.number] = PartReceipt.recorded(shard, part.number, rec)
        target = GcsTarget(url, self.storage, bucket, prefix)
        generation = int(there["generation"]) if there else 0
        return OpenShard(
            shard, size, target, done, {"upload_id": upload_id, "generation": generation}
        )

    def complete(self, shard: OpenShard) -> None:
        target = shard.target
        assert isinstance(target, GcsTarget)
        _, bucket, key, parts = self._where(shard.name)
        upload_id = shard.resume["upload_id"]
        sources = [
            (part_name(target.prefix, n), int(r.etag.split("/")[0]))  # type: ignore[union-attr]
            for n, r in sorted(shard.done.items())
        ]
        with reported(target.url, "write", "output"):
            answer = self._run(_compose_all, bucket, key, target.prefix, sources,
                               shard.resume["generation"], upload_id)  # fmt: skip
            if int(answer["size"]) != shard.size:
                raise RamDistError(f"{target.url}: composed {answer['size']} bytes, expected "
                                   f"{shard.size}")  # fmt: skip
            listed = self._run(gcs.listing, bucket, parts)
            self._run(gcs.delete_all, bucket, [o["name"] for o in listed])
        fs, _ = self.storage.fs(self.out_url)
        fs.invalidate_cache()

    def abort(self, shard: OpenShard) -> None:
        target = shard.target
        assert isinstance(target, GcsTarget)
        try:
            listed = self._run(gcs.listing, target.bucket, target.prefix)
            self._run(gcs.delete_all, target.bucket, [o["name"] for o in listed])
        except OSError:
            pass  # the next run of the job, or the bucket's lifecycle rule, clears them


async def _compose_all(
    fs: Any,
    bucket: str,
    key: str,
    prefix: str,
    sources: list[tuple[str, int]],
    generation: int,
    upload_id: str,
) -> dict[str, Any]:
    """Compose `sources` into `key` at `generation`: groups of `MAX_COMPOSE_SOURCES` into
    intermediate composites under `prefix`, level by level, while there are more. A final
    compose refused by its preconditions that had landed already (a retried request) is
    recognised by the upload id the shard carries."""
    level = 0
    while len(sources) > gcs.MAX_COMPOSE_SOURCES:
        level += 1

        async def one(name: str, group: list[tuple[str, int]]) -> tuple[str, int]:
            if len(group) == 1:
                return group[0]
            made = await gcs.compose(fs, bucket, name, group)
            return made["name"], int(made["generation"])

        n = gcs.MAX_COMPOSE_SOURCES
        groups = [sources[i : i + n] for i in range(0, len(sources), n)]
        sources = list(
            await asyncio.gather(
                *(one(f"{prefix}c{level}-{i:05d}{PART_SUFFIX}", g) for i, g in enumerate(groups))
            )
        )
    try:
        return await gcs.compose(
            fs, bucket, key, sources, if_generation_match=generation,
            metadata={UPLOAD_KEY: upload_id},
        )  # fmt: skip
    except Exception as e:
        if conditional(e) != "precondition":
            raise
        there = await gcs.stat(fs, bucket, key)
        if there is not None and (there.get("metadata") or {}).get(UPLOAD_KEY) == upload_id:
            return there
        raise RamDistError(
            f"gs://{bucket}/{key}: the shard or one of its parts changed while this run wrote "
            "it (another run writing the same output?); nothing of it was published"
        ) from e
