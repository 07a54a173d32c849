"""An exclusive, renewed lease on a merge's output location: one writer at a time.

A merge claims its output before writing anything by creating `LEASE_NAME` inside the output
folder or prefix, a small JSON record of who holds it (`Holder`). A second run into the same
output finds the record and is refused with the holder's name (`LeaseHeld`); `--overwrite`
does not change that. The holder renews the record every `RENEW_EVERY_S`; a record not
renewed for `STALE_AFTER_S`, or one left by a process that no longer exists on this host, is
taken over.

How each kind of store makes the claim exclusive:

- a local (or network) filesystem: created with `O_CREAT | O_EXCL`. An existing record is
  only changed while holding a guard file (itself `O_EXCL`, held for milliseconds): renewed
  by writing a temporary file and `os.replace` while it is still ours, and a dead holder's
  record deleted only while it is still the very record judged dead (same inode, time and
  size), then created again with `O_EXCL`.
- S3 (s3fs): a conditional `PutObject` with `If-None-Match: *` (the store refuses a second
  create with 412 Precondition Failed); renewed and taken over with `PutObject` `If-Match` the
  ETag last seen, released with `DeleteObject` `If-Match` our ETag. A store that ignores these
  headers (some S3-compatible servers) gives no protection beyond the other checks here.
- GCS (gcsfs): an upload with `ifGenerationMatch=0` (the store refuses a second create with
  412); renewed and taken over by an upload, released by a delete, each `ifGenerationMatch`
  the generation last seen.
- any other fsspec filesystem (hf://, memory://, ...): best effort only. The record is
  written when `fs.exists` says there is none, then read back after `SETTLE_S` to check that
  it is ours; two runs starting within the same moment may both believe they hold it, and
  the loser finds out at its next renewal (`OutputLease.lost`).

Staleness is judged on the holder's clock (`renewed`), so hosts sharing an output should keep
their clocks within `STALE_AFTER_S - RENEW_EVERY_S` of each other.

Storage options are never written into the lease or into a message.

Modules: `output` (the lease, `OutputLease`), `store` (its record and what a store must
do), one per kind of store (`local`, `s3`, `gcs`, `best_effort`) and `host` (this host's
processes).
"""

from ram_dist.io.lease.output import (
    ATTEMPTS,
    LEASE_NAME,
    RENEW_EVERY_S,
    STALE_AFTER_S,
    OutputLease,
)
from ram_dist.io.lease.store import MAX_LEASE_BYTES, Holder, LeaseHeld

__all__ = [
    "ATTEMPTS",
    "LEASE_NAME",
    "MAX_LEASE_BYTES",
    "RENEW_EVERY_S",
    "STALE_AFTER_S",
    "Holder",
    "LeaseHeld",
    "OutputLease",
]
