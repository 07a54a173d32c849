"""The driver's record of the map pass in the manifest (`ShardBook`): shards being written,
their parts, and finished shards with their digests."""

from __future__ import annotations

import time
from collections.abc import Callable

from ram_dist.io.manifest import Manifest
from ram_dist.io.sinks import OpenShard, PartReceipt, plan_record, shard_digest
from ram_dist.planning.units import Part


class ShardBook:
    """The driver's record of what the map pass has written, kept in the manifest: each
    shard being written (how it is cut into parts, its upload, the parts already in) and
    each finished shard with its digest. A part's record is saved at most every
    `every_s` seconds (a store may hold a part the manifest does not know yet: on S3 a
    resumed upload lists its parts); a shard opened or finished is saved at once."""

    def __init__(
        self,
        manifest: Manifest,
        save: Callable[[], None],
        check: Callable[[], None] = lambda: None,
        every_s: float = 2.0,
    ) -> None:
        self.manifest = manifest
        self._save = save
        self._check = check
        """Raises when the job may no longer write (it lost the output's lease)."""
        self._every_s = every_s
        self._saved = time.monotonic()

    def save(self, now: bool = True) -> None:
        self._check()
        if now or time.monotonic() - self._saved >= self._every_s:
            self._save()
            self._saved = time.monotonic()

    def opened(self, shard: OpenShard, plan: list[Part]) -> None:
        self.manifest.writing[shard.name] = {
            "plan": plan_record(plan),
            **shard.resume,
            "parts": {str(n): r.record() for n, r in sorted(shard.done.items())},
        }
        self.save()

    def part_done(self, receipt: PartReceipt) -> None:
        self.manifest.writing[receipt.shard]["parts"][str(receipt.number)] = receipt.record()
        self.save(now=False)

    def finished(self, shard: OpenShard) -> str:
        parts = [shard.done[n] for n in sorted(shard.done)]
        digest = shard_digest([p.sha256 for p in parts])
        self.manifest.shards[shard.name] = {
            "size": shard.size,
            "digest": digest,
            "parts": [p.record() for p in parts],
        }
        self.manifest.writing.pop(shard.name, None)
        self.save()
        return digest

    def dropped(self, shard: str) -> None:
        self.manifest.writing.pop(shard, None)
