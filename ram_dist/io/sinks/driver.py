"""The fallback for stores workers cannot write a shard's parts to: workers send their
parts' bytes back and the driver appends them to the shard in order."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ram_dist.io.sinks.base import (
    THROUGH_DRIVER,
    OpenShard,
    OutputSink,
    Part,
    PartReceipt,
    ShardTarget,
)
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import AtomicFile


@dataclass(frozen=True)
class DriverTarget(ShardTarget):
    """The fallback: the task sends the part's bytes back, the driver appends them in order."""

    url: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        return PartReceipt.of(part, sha256.hex(), None, data)


class OrderedWriter:
    """Appends parts to an `AtomicFile` in part order, in a thread of its own (file and
    upload writes release the GIL), so the driver goes on collecting results meanwhile."""

    def __init__(self, url: str, storage: Storage) -> None:
        self.file = AtomicFile(url, storage)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ram-dist-write")
        self._pending: list[Future[None]] = []
        self._waiting: dict[int, PartReceipt] = {}
        self._next = 1

    def add(self, receipt: PartReceipt, on_write: Callable[[int], None]) -> None:
        self._waiting[receipt.number] = receipt
        while self._next in self._waiting:
            r = self._waiting.pop(self._next)
            assert r.data is not None
            self._pending.append(self._pool.submit(self._write, r.data, on_write))
            self._next += 1
        while len(self._pending) > 4:
            self._pending.pop(0).result()

    def _write(self, data: np.ndarray, on_write: Callable[[int], None]) -> None:
        self.file.write(memoryview(data).cast("B"))
        on_write(len(data))

    def drain(self) -> None:
        while self._pending:
            self._pending.pop(0).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


class DriverSink(OutputSink):
    """The fallback for stores workers cannot write a shard's parts to (hf://, a
    local folder on several nodes): the ordered stream through the driver."""

    path = THROUGH_DRIVER

    @classmethod
    def choose(
        cls, out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
    ) -> OutputSink:
        fs, _ = storage.fs(out_url)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return cls(out_url, storage, f"{protocol}:// takes no parts from several writers "
                   "here: the driver streams each shard in order")  # fmt: skip

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        url = join(self.out_url, shard)
        opened = OpenShard(shard, size, DriverTarget(url), {}, {})
        opened.writer = OrderedWriter(url, self.storage)
        return opened

    def accept(self, shard: OpenShard, receipt: PartReceipt) -> None:
        assert shard.writer is not None

        def counted(n: int) -> None:
            self.bytes_written_by_driver += n

        shard.writer.add(receipt, counted)

    def complete(self, shard: OpenShard) -> None:
        writer = shard.writer
        assert writer is not None
        writer.drain()
        writer.close()
        if writer.file.written != shard.size:
            writer.file.discard()
            raise RuntimeError(f"{writer.file.url}: wrote {writer.file.written} bytes, "
                               f"expected {shard.size}")  # fmt: skip
        writer.file.commit()

    def abort(self, shard: OpenShard) -> None:
        if shard.writer is not None:
            shard.writer.close()
            shard.writer.file.discard()
