"""Where merged bytes go: one output sink per kind of store, in Ray Data's datasink shape.

A shard is opened on the driver (a multipart upload on S3; a partial file at its final size
on a filesystem every worker sees; an ordered stream otherwise), its parts are written by the
tasks that computed them (`ShardTarget.write`, on a worker), and the driver completes it once
every part is in (complete the upload, rename the file) or aborts it on failure. Nothing
appears under a shard's final name before it is whole.

A shard's digest is defined from its parts: the sha256 of the concatenated sha256 digests of
its parts, in order (S3's composite SHA-256 checksum of a multipart object), so it is known
without re-reading the shard and `ram-dist verify` can re-check it part by part.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ram_dist.io.backends import backend_of, load
from ram_dist.io.failures import reported
from ram_dist.io.s3 import MIN_PART_BYTES
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import PARTIAL_SUFFIX, AtomicFile

DIRECT = "direct"
THROUGH_DRIVER = "through-driver"


class Part(Protocol):
    """What a sink needs of a part (the planner's `units.Part`): bytes [start, stop) of a
    shard, numbered from 1 within it. A protocol, so io does not import the planner."""

    @property
    def shard(self) -> str: ...
    @property
    def number(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def size(self) -> int: ...


@dataclass(frozen=True)
class PartReceipt:
    """What a task sends back for the part it wrote: where it is and its digest; the bytes
    themselves only on the through-driver path."""

    shard: str
    number: int
    start: int
    stop: int
    sha256: str
    etag: str | None = None
    data: np.ndarray | None = field(default=None, compare=False, repr=False)

    def record(self) -> dict[str, Any]:
        """The manifest's entry for this part."""
        out: dict[str, Any] = {"start": self.start, "stop": self.stop, "sha256": self.sha256}
        if self.etag is not None:
            out["etag"] = self.etag
        return out


def shard_digest(part_sha256: list[str]) -> str:
    """The shard's digest from its parts' sha256 digests (hex), in part order."""
    return hashlib.sha256(b"".join(bytes.fromhex(h) for h in part_sha256)).hexdigest()


class ShardTarget:
    """A shard open for writing; picklable, shipped to the tasks that write its parts."""

    url: str
    streams: bool = False
    """Whether a task writes the part's bytes as they are made (`write_at`), so writing
    overlaps the merge; else it hands over the whole part in `write`."""

    def write_at(self, offset: int, data: np.ndarray) -> None:
        """On a worker, streaming targets only: put bytes at `offset` in the shard."""
        raise NotImplementedError

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        """On a worker: put `data` (the part's bytes) in place, unless they were streamed
        already, and say what was written."""
        raise NotImplementedError


@dataclass(frozen=True)
class S3Target(ShardTarget):
    """One multipart upload; each part is uploaded by the task that computed it, with its
    SHA-256 so the store itself refuses a corrupted upload."""

    url: str
    bucket: str
    key: str
    upload_id: str
    storage: Storage

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        fs, _ = self.storage.fs(self.url)
        with reported(self.url, "write", "output"):
            answer = fs.call_s3(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=part.number,
                Body=data.tobytes(),
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=base64.b64encode(sha256).decode(),
            )
        return PartReceipt(
            part.shard, part.number, part.start, part.stop, sha256.hex(), answer["ETag"]
        )


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
        return PartReceipt(part.shard, part.number, part.start, part.stop, sha256.hex())


#: Largest single `pwrite` (Linux caps one call at about 2 GiB).
_WRITE_BYTES = 1 << 30


@dataclass(frozen=True)
class DriverTarget(ShardTarget):
    """The fallback: the task sends the part's bytes back, the driver appends them in order."""

    url: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        return PartReceipt(part.shard, part.number, part.start, part.stop, sha256.hex(), None, data)


@dataclass
class OpenShard:
    """The driver's side of a shard being written."""

    name: str
    size: int
    target: ShardTarget
    done: dict[int, PartReceipt]
    """Parts already in place (a resumed shard's), by number."""
    resume: dict[str, Any]
    """What the manifest keeps of it while it is written (e.g. the upload id)."""
    writer: _OrderedWriter | None = None


class OutputSink:
    """Runs on the driver: opens, completes and aborts shards of one output location."""

    path: str = DIRECT
    min_part_bytes: int = 0
    """The smallest part the store takes (all but a shard's last)."""

    def __init__(self, out_url: str, storage: Storage, reason: str) -> None:
        self.out_url = out_url
        self.storage = storage
        self.reason = reason
        self.bytes_written_by_driver = 0

    @classmethod
    def choose(
        cls, out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
    ) -> OutputSink:
        """The sink of this kind for `out_url`, or the one to use instead (see `choose_sink`)."""
        raise NotImplementedError

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        """Start writing `shard` (`size` bytes, cut into `plan`), continuing `old` (the
        manifest's record of an unfinished write) where the store still holds its parts."""
        raise NotImplementedError

    def accept(self, shard: OpenShard, receipt: PartReceipt) -> None:
        """A part is in (the through-driver sink writes it here)."""

    def complete(self, shard: OpenShard) -> None:
        raise NotImplementedError

    def abort(self, shard: OpenShard) -> None:
        raise NotImplementedError


def _plan_record(plan: list[Part]) -> list[list[int]]:
    return [[p.start, p.stop] for p in plan]


def _kept_parts(plan: list[Part], old: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """The recorded parts of an unfinished write, when it was cut the same way as now."""
    if not old or old.get("plan") != _plan_record(plan):
        return {}
    return {int(n): rec for n, rec in (old.get("parts") or {}).items()}


def _receipt(shard: str, number: int, rec: dict[str, Any]) -> PartReceipt:
    return PartReceipt(shard, number, rec["start"], rec["stop"], rec["sha256"], rec.get("etag"))


class S3Sink(OutputSink):
    """One multipart upload per shard, parts uploaded by the workers."""

    min_part_bytes = MIN_PART_BYTES

    @classmethod
    def choose(
        cls, out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
    ) -> OutputSink:
        return cls(out_url, storage, "S3: workers upload the parts of a multipart upload")

    def _call(self, method: str, **kwargs: Any) -> Any:
        fs, _ = self.storage.fs(self.out_url)
        return fs.call_s3(method, **kwargs)

    def _where(self, shard: str) -> tuple[str, str, str]:
        url = join(self.out_url, shard)
        fs, path = self.storage.fs(url)
        bucket, key, _ = fs.split_path(path)
        return url, bucket, key

    def open(
        self, shard: str, size: int, plan: list[Part], old: dict[str, Any] | None
    ) -> OpenShard:
        url, bucket, key = self._where(shard)
        kept = _kept_parts(plan, old)
        upload_id = (old or {}).get("upload_id")
        listed: dict[int, dict[str, Any]] | None = None
        if upload_id is not None and (old or {}).get("plan") == _plan_record(plan):
            listed = self._list_parts(bucket, key, upload_id)  # None: the upload is gone
        if listed is None:
            if upload_id is not None:
                self._abort(bucket, key, upload_id)
            with reported(url, "write", "output"):
                answer = self._call(
                    "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256"
                )
            upload_id, listed = answer["UploadId"], {}
        done = {}
        for part in plan:
            # A part the store holds for this upload and plan was made by this same job (the
            # manifest's identity matched): its bytes are right, and the store checked them
            # against their SHA-256. Its digest comes from the manifest, or from the store's
            # listing (S3 lists each part's checksum; a store that does not, like moto, keeps
            # only the parts the manifest recorded).
            there = listed.get(part.number)
            if there is None or there["Size"] != part.size:
                continue
            held = there.get("ChecksumSHA256")
            listed_sha = base64.b64decode(held).hex() if held else None
            rec = kept.get(part.number)
            if rec is not None and rec.get("etag") == there["ETag"]:
                sha = rec["sha256"]
                if listed_sha not in (None, sha):
                    continue
            elif rec is None and listed_sha is not None:
                sha = listed_sha
            else:
                continue
            done[part.number] = PartReceipt(
                shard, part.number, part.start, part.stop, sha, there["ETag"]
            )
        target = S3Target(url, bucket, key, upload_id, self.storage)
        return OpenShard(shard, size, target, done, {"upload_id": upload_id})

    def _list_parts(
        self, bucket: str, key: str, upload_id: str
    ) -> dict[int, dict[str, Any]] | None:
        """The parts an unfinished upload holds, or None when the upload is gone."""
        parts: dict[int, dict[str, Any]] = {}
        marker = 0
        while True:
            try:
                answer = self._call(
                    "list_parts", Bucket=bucket, Key=key, UploadId=upload_id,
                    PartNumberMarker=marker, MaxParts=1000,
                )  # fmt: skip
            except (FileNotFoundError, OSError):
                return None
            for p in answer.get("Parts", []):
                parts[p["PartNumber"]] = p
            if not answer.get("IsTruncated"):
                return parts
            marker = answer["NextPartNumberMarker"]

    def complete(self, shard: OpenShard) -> None:
        target = shard.target
        assert isinstance(target, S3Target)
        parts = [
            {
                "PartNumber": n,
                "ETag": r.etag,
                "ChecksumSHA256": base64.b64encode(bytes.fromhex(r.sha256)).decode(),
            }
            for n, r in sorted(shard.done.items())
        ]
        with reported(target.url, "write", "output"):
            self._call(
                "complete_multipart_upload", Bucket=target.bucket, Key=target.key,
                UploadId=target.upload_id, MultipartUpload={"Parts": parts},
            )  # fmt: skip
        fs, _ = self.storage.fs(self.out_url)
        fs.invalidate_cache()

    def abort(self, shard: OpenShard) -> None:
        target = shard.target
        assert isinstance(target, S3Target)
        self._abort(target.bucket, target.key, target.upload_id)

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except (FileNotFoundError, OSError):
            pass  # already gone


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
        kept = _kept_parts(plan, old)
        if not (kept and os.path.exists(partial) and os.path.getsize(partial) == size):
            kept = {}
            with reported(url, "write", "output"):
                os.makedirs(os.path.dirname(partial), exist_ok=True)
                with open(partial, "wb") as f:
                    f.truncate(size)
        done = {n: _receipt(shard, n, rec) for n, rec in kept.items()}
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


class _OrderedWriter:
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
    """The fallback for stores workers cannot write a shard's parts to (gs://, hf://, a
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
        opened.writer = _OrderedWriter(url, self.storage)
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


def choose_sink(
    out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
) -> OutputSink:
    """The sink for an output location, with why, in words (for `plan` and the report): its
    backend's (`backends`).

    `shared`: the user declared a local output path mounted on every node (`--output-shared`);
    `single_node`: the cluster is one node (None: not known yet, as in `ram-dist plan`)."""
    storage.fs(out_url)  # an unknown protocol or a missing client fails here
    sink: type[OutputSink] = load(backend_of(out_url).sink)
    return sink.choose(out_url, storage, shared=shared, single_node=single_node)
