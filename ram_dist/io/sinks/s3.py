"""S3: one multipart upload per shard, its parts uploaded by the workers that made them."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from ram_dist.io.failures import reported
from ram_dist.io.s3 import MIN_PART_BYTES
from ram_dist.io.sinks.base import OpenShard, OutputSink, Part, PartReceipt, StoreTarget, kept_parts
from ram_dist.io.storage import join


@dataclass(frozen=True)
class S3Target(StoreTarget):
    """One multipart upload; each part is uploaded by the task that computed it, with its
    SHA-256 so the store itself refuses a corrupted upload."""

    bucket: str
    key: str
    upload_id: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        with reported(self.url, "write", "output"):
            answer = self.fs().call_s3(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=part.number,
                Body=data.tobytes(),
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=base64.b64encode(sha256).decode(),
            )
        return PartReceipt.of(part, sha256.hex(), answer["ETag"])


class S3Sink(OutputSink):
    """One multipart upload per shard, parts uploaded by the workers."""

    min_part_bytes = MIN_PART_BYTES
    chosen = "S3: workers upload the parts of a multipart upload"

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
        kept = kept_parts(plan, old)
        upload_id = (old or {}).get("upload_id")
        listed: dict[int, dict[str, Any]] | None = None
        if upload_id is not None and kept is not None:
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
            rec = (kept or {}).get(part.number)
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
        target = S3Target(url, self.storage, bucket, key, upload_id)
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
