"""Where merged bytes go: one output sink per kind of store, in Ray Data's datasink shape.

A shard is opened on the driver (a multipart upload on S3; a partial file at its final size
on a filesystem every worker sees; an ordered stream otherwise), its parts are written by the
tasks that computed them (`ShardTarget.write`, on a worker), and the driver completes it once
every part is in (complete the upload, rename the file) or aborts it on failure. Nothing
appears under a shard's final name before it is whole.

A shard's digest is defined from its parts: the sha256 of the concatenated sha256 digests of
its parts, in order (S3's composite SHA-256 checksum of a multipart object), so it is known
without re-reading the shard and `ram-dist verify` can re-check it part by part.

Modules: `base` (what every sink shares, and `choose_sink`), one per kind of store: `s3`
(multipart uploads), `gcs` (an object per part, composed), `file` (ranges written in place)
and `driver` (the ordered stream).
"""

from ram_dist.io.sinks.base import (
    DIRECT,
    THROUGH_DRIVER,
    KeptTarget,
    OpenShard,
    OutputSink,
    Part,
    PartReceipt,
    ShardTarget,
    choose_sink,
    plan_record,
    shard_digest,
)
from ram_dist.io.sinks.driver import DriverSink, DriverTarget
from ram_dist.io.sinks.file import FileSink, FileTarget
from ram_dist.io.sinks.s3 import S3Sink, S3Target

__all__ = [
    "DIRECT",
    "THROUGH_DRIVER",
    "DriverSink",
    "DriverTarget",
    "FileSink",
    "FileTarget",
    "KeptTarget",
    "OpenShard",
    "OutputSink",
    "Part",
    "PartReceipt",
    "S3Sink",
    "S3Target",
    "ShardTarget",
    "choose_sink",
    "plan_record",
    "shard_digest",
]
