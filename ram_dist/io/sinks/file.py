"""A filesystem every worker sees: each worker writes its ranges in place into a partial
file at the shard's final size, renamed once whole."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ram_dist.io.failures import reported
from ram_dist.io.sinks.base import OpenShard, OutputSink, Part, PartReceipt, ShardTarget, kept_parts
from ram_dist.io.sinks.driver import DriverSink
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import PARTIAL_SUFFIX


@dataclass(frozen=True)
class FileTarget(ShardTarget):
    """A partial file at the shard's final size; each task writes its range in place, block
    by block while it merges the next."""

    url: str
    partial: str
    streams = True

    def write_at(self, offset: int, data: np.ndarray) -> None:
        with reported(self.url, "write", "output"):
            fd = os.open(self.partial, os.O_WRONLY)
            try:
                view, done = memoryview(data).cast("B"), 0
                while done < len(view):
                    done += os.pwrite(fd, view[done : done + _WRITE_BYTES], offset + done)
            finally:
                os.close(fd)

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        return PartReceipt.of(part, sha256.hex())


#: Largest single `pwrite` (Linux caps one call at about 2 GiB).
_WRITE_BYTES = 1 << 30


class FileSink(OutputSink):
    """A filesystem every worker sees: workers `pwrite` their ranges into a partial file
    that the driver created at the shard's final size, and renames when every part is in."""

    @classmethod
    def choose(
        cls, out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
    ) -> OutputSink:
        """In place where every worker sees the folder, else through the driver."""
        if shared:
            return cls(out_url, storage, "a shared filesystem (--output-shared): workers "
                       "write their ranges in place")  # fmt: skip
        if single_node is None:
            return cls(out_url, storage, "a local folder: workers write their ranges in "
                       "place when the cluster is one node (or with --output-shared); "
                       "on several nodes, through the driver")  # fmt: skip
        if single_node:
            return cls(out_url, storage, "a local folder on a one-node cluster: workers "
                       "write their ranges in place")  # fmt: skip
        return DriverSink(out_url, storage, "a local folder on a cluster of several nodes "
                          "without --output-shared: only the driver's node sees it")  # fmt: skip

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        url = join(self.out_url, shard)
        _, path = self.storage.fs(url)
        partial = path + PARTIAL_SUFFIX
        kept = kept_parts(plan, old) or {}
        if not (kept and os.path.exists(partial) and os.path.getsize(partial) == size):
            kept = {}
            with reported(url, "write", "output"):
                os.makedirs(os.path.dirname(partial), exist_ok=True)
                with open(partial, "wb") as f:
                    f.truncate(size)
        done = {n: PartReceipt.recorded(shard, n, rec) for n, rec in kept.items()}
        return OpenShard(shard, size, FileTarget(url, partial), done, {})

    def complete(self, shard: OpenShard) -> None:
        # No fsync, as before workers wrote: a killed process's writes are in the page cache
        # and a resumed run finds them; `ram-dist verify` re-checks every part's digest.
        target = shard.target
        assert isinstance(target, FileTarget)
        _, path = self.storage.fs(target.url)
        with reported(target.url, "write", "output"):
            os.replace(target.partial, path)

    def abort(self, shard: OpenShard) -> None:
        target = shard.target
        assert isinstance(target, FileTarget)
        if os.path.exists(target.partial):
            os.remove(target.partial)
