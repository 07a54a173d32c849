"""Azure Blob: each worker stages its part of a shard as a block of the shard's blob (Put
Block), and the driver commits the shard with one Put Block List, so nothing is visible
under the shard's name before it is whole.

Block ids are `azure.block_id(token, part number)`: the same length for every block of a
blob, in part order, and `token` is drawn per upload, so a block staged by another upload of
the same blob (an older run's) is never committed. A re-run of the same job continues the
upload the manifest records: blocks the store still holds uncommitted, of the right size and
recorded in the manifest, are kept. Azure deletes uncommitted blocks only with their blob:
an aborted shard's blob is deleted when nothing of it was ever committed; otherwise, and
after a killed run, the store discards uncommitted blocks at the next Put Block List of
that blob (the re-run's commit) or a week after the blob's last Put Block.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
from fsspec.asyn import sync

from ram_dist.io.azure import block_id, error_code
from ram_dist.io.failures import reported
from ram_dist.io.s3 import MIN_PART_BYTES
from ram_dist.io.sinks.base import OpenShard, OutputSink, Part, PartReceipt, StoreTarget, kept_parts
from ram_dist.io.storage import join


def _blob(fs: Any, container: str, blob: str) -> Any:
    """The asynchronous `BlobClient` of a blob, on adlfs's own service client (its
    credentials, its retry policy, its event loop: `fsspec.asyn.sync(fs.loop, ...)`)."""
    return fs.service_client.get_blob_client(container=container, blob=blob)


@dataclass(frozen=True)
class AzureTarget(StoreTarget):
    """A shard's blob and its upload's token."""

    container: str
    blob: str
    token: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        fs = self.fs()
        client = _blob(fs, self.container, self.blob)
        with reported(self.url, "write", "output"):
            # validate_content: the request carries the block's MD5 (transactional), so the
            # store refuses a block corrupted on the way.
            sync(fs.loop, client.stage_block, block_id(self.token, part.number),
                 data.tobytes(), length=data.nbytes, validate_content=True)  # fmt: skip
        return PartReceipt.of(part, sha256.hex())


class AzureSink(OutputSink):
    """One block list per shard, blocks staged by the workers."""

    min_part_bytes = MIN_PART_BYTES
    chosen = "Azure Blob: workers stage the blocks of each shard's blob"

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        url = join(self.out_url, shard)
        fs, path = self.storage.fs(url)
        container, blob, _ = fs.split_path(path)
        token = (old or {}).get("token")
        kept = kept_parts(plan, old)
        held: dict[str, int] = {}
        if token is not None and kept is not None:
            held = self._uncommitted(fs, url, container, blob)
        else:
            token = secrets.token_hex(8)
        done = {}
        for part in plan:
            # A block the store holds for this upload, recorded by the manifest after the
            # store took it (and checked its MD5), is this job's part: keep it.
            rec = (kept or {}).get(part.number)
            if rec is not None and held.get(block_id(token, part.number)) == part.size:
                done[part.number] = PartReceipt(
                    shard, part.number, part.start, part.stop, rec["sha256"]
                )
        target = AzureTarget(url, self.storage, container, blob, token)
        return OpenShard(shard, size, target, done, {"token": token})

    def _uncommitted(self, fs: Any, url: str, container: str, blob: str) -> dict[str, int]:
        """The blob's uncommitted blocks, id to size (none when the blob is not there)."""
        from azure.core.exceptions import ResourceNotFoundError

        client = _blob(fs, container, blob)
        with reported(url, "list", "output"):
            try:
                _, uncommitted = sync(fs.loop, client.get_block_list, "uncommitted")
            except ResourceNotFoundError as e:
                if (error_code(e) or (None,))[0] != "BlobNotFound":
                    raise  # its container is gone
                return {}
        return {b.id: b.size for b in uncommitted}

    def complete(self, shard: OpenShard) -> None:
        from azure.storage.blob import BlobBlock

        target = shard.target
        assert isinstance(target, AzureTarget)
        fs, _ = self.storage.fs(target.url)
        blocks = [BlobBlock(block_id(target.token, n)) for n in sorted(shard.done)]
        with reported(target.url, "write", "output"):
            sync(fs.loop, _blob(fs, target.container, target.blob).commit_block_list, blocks)
        fs.invalidate_cache()

    def abort(self, shard: OpenShard) -> None:
        """Delete the blob when it holds only this upload's uncommitted blocks (the run's
        record of them is dropped); a committed blob at that name (an older output) is left,
        its uncommitted blocks to the store (see the module). Best effort: the job is failing
        already."""
        target = shard.target
        assert isinstance(target, AzureTarget)
        fs, _ = self.storage.fs(target.url)
        client = _blob(fs, target.container, target.blob)
        try:
            committed, _ = sync(fs.loop, client.get_block_list, "committed")
            if not committed:
                sync(fs.loop, client.delete_blob)
        except Exception:  # noqa: BLE001, S110  (gone already, or the store is failing)
            pass
