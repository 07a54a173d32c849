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
- any other fsspec filesystem (gs://, hf://, memory://, ...): best effort only. The record is
  written when `fs.exists` says there is none, then read back after `SETTLE_S` to check that
  it is ours; two runs starting within the same moment may both believe they hold it, and
  the loser finds out at its next renewal (`OutputLease.lost`).

Staleness is judged on the holder's clock (`renewed`), so hosts sharing an output should keep
their clocks within `STALE_AFTER_S - RENEW_EVERY_S` of each other.

Storage options are never written into the lease or into a message.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.asyn import sync
from fsspec.implementations.local import LocalFileSystem

from ram_dist.errors import RamDistError
from ram_dist.io.failures import explained, is_storage_failure
from ram_dist.io.storage import Storage, join, protocol_of

LEASE_NAME = ".ram-dist-lease.json"
#: A lease not renewed for this long may be taken over.
STALE_AFTER_S = 120.0
RENEW_EVERY_S = 20.0
#: Most bytes read from a lease; a longer one is unreadable (an unknown holder).
MAX_LEASE_BYTES = 64 * 1024
#: Best-effort stores: wait this long after writing a lease before reading it back.
SETTLE_S = 0.25
#: Rounds of create / judge / take over before giving up on a contended location.
ATTEMPTS = 8
#: Local filesystems: the guard file held while an existing lease is checked and changed,
#: and the age at which a guard counts as left by a dead process.
GUARD_SUFFIX = ".guard"
GUARD_STALE_S = 10.0

log = logging.getLogger(__name__)


class LeaseHeld(RamDistError):
    """Another live run holds the output location."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: a job on a host, its process, when it took and last renewed the
    lease (epoch seconds). `machine` (this boot of this host and its pid namespace, where the
    platform says) keeps two machines or containers that share a host name apart before a
    holder is judged by its pid."""

    job: str
    host: str
    pid: int
    started: float
    renewed: float
    machine: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Holder:
        """Parse a lease; `ValueError` when it is not one."""
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("a lease is a JSON object")
        job, host, pid = value.get("job"), value.get("host"), value.get("pid")
        started, renewed = value.get("started"), value.get("renewed")
        machine = value.get("machine", "")
        if not (isinstance(job, str) and isinstance(host, str) and isinstance(machine, str)):
            raise ValueError("job, host and machine are strings")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ValueError("pid is an integer")
        for t in (started, renewed):
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
                raise ValueError("started and renewed are epoch seconds")
        return cls(job, host, pid, float(started), float(renewed), machine)

    def same_claim(self, other: Holder | None) -> bool:
        """The same acquisition by the same process (renewals differ only in `renewed`)."""
        return other is not None and (
            self.job,
            self.host,
            self.pid,
            self.started,
            self.machine,
        ) == (other.job, other.host, other.pid, other.started, other.machine)


@dataclass(frozen=True)
class _Seen:
    """A lease as read: its holder (None when unreadable), when the store last modified it
    (epoch seconds, None when the store does not say) and a version that changes with every
    write (inode/time/size, an ETag, or the bytes themselves)."""

    holder: Holder | None
    modified: float | None
    version: Any


class OutputLease:
    """Runs on the driver: claims `out_url` for one job, renews the claim in a daemon thread
    while the job runs, and gives it up at the end.

        lease = OutputLease(out, storage, job_id)
        with lease:               # acquire (LeaseHeld if a live run holds it) + renew
            ...                   # check `lease.lost` before committing
        # lease.note: how the lease was taken over, if it was

    `acquire` may also be called before `with` (to log its note first); `with` then only
    starts renewing.
    """

    def __init__(
        self,
        out_url: str,
        storage: Storage,
        job: str,
        *,
        stale_after_s: float = STALE_AFTER_S,
        renew_every_s: float = RENEW_EVERY_S,
    ) -> None:
        if not (stale_after_s > 0 and renew_every_s > 0):
            raise ValueError("stale_after_s and renew_every_s must be positive")
        if renew_every_s >= stale_after_s:
            raise ValueError(
                f"renew_every_s ({renew_every_s}) must be shorter than "
                f"stale_after_s ({stale_after_s})"
            )
        self.out_url = out_url
        self.url = join(out_url, LEASE_NAME)
        self.job = job
        self.stale_after_s = float(stale_after_s)
        self.renew_every_s = float(renew_every_s)
        self.note: str | None = None
        """Set by `acquire` when it took over a dead or stale holder's lease."""
        self._storage = storage
        self._store = _store_for(self.url, storage)
        self._host = socket.gethostname()
        self._machine = _machine_id()
        self._lock = threading.Lock()
        self._holder: Holder | None = None
        self._version: Any = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"OutputLease({self.url!r}, job={self.job!r})"

    @property
    def held(self) -> bool:
        return self._holder is not None and self._lost is None

    @property
    def lost(self) -> str | None:
        """Why the lease is no longer ours, once a renewal found it gone or taken."""
        return self._lost

    def acquire(self) -> str | None:
        """Claim the location: None when it was free, a one-line note when a dead or stale
        holder's lease was taken over; `LeaseHeld` when a live holder has it."""
        if self._holder is not None:
            raise RuntimeError(f"{self!r} is already acquired")
        self.note = None
        try:
            return self._acquire()
        except RamDistError:
            raise
        except Exception as e:
            if not is_storage_failure(e):
                raise
            where = f"{self.url}: cannot claim the output location"
            raise explained(where, e, self.url, "write") from e

    def _acquire(self) -> str | None:
        self._store.prepare(self._storage, self.out_url)
        for _ in range(ATTEMPTS):
            now = time.time()
            mine = Holder(self.job, self._host, os.getpid(), now, now, self._machine)
            data = mine.to_json().encode()
            note: str | None = None
            version = self._store.create(data)
            if version is None:
                seen = self._read_settled()
                if seen is None:
                    continue  # released meanwhile: try to create again
                if mine.same_claim(seen.holder):  # our create landed, its reply did not
                    version = seen.version
                else:
                    reason = self._why_free(seen)
                    if reason is None:
                        raise LeaseHeld(self._held_message(seen))
                    version = self._store.take_over(data, seen.version)
                    if version is None:
                        continue  # another run changed it first: judge it afresh
                    note = f"took over {self._describe(seen.holder)}: {reason}"
            with self._lock:
                self._holder, self._version, self._lost = mine, version, None
            self.note = note
            return note
        raise LeaseHeld(
            f"{self.url}: could not claim the output location after {ATTEMPTS} attempts: "
            "other runs keep creating or replacing its lease. Check which jobs write to "
            f"{self.out_url} and run again."
        )

    def release(self) -> None:
        """Remove the lease if it is still ours. Idempotent; a lease already gone, or taken
        by another run, is left alone, and a store error is logged, not raised (a lease left
        behind goes stale)."""
        with self._lock:
            version, self._version = self._version, None
            holder, self._holder = self._holder, None
        if version is None or holder is None:
            return
        try:
            self._store.remove(version)
        except Exception as e:  # noqa: BLE001  (a lease left behind only goes stale)
            log.warning(
                "%s: could not remove the lease (%s); it counts as stale %.0f s after its "
                "last renewal",
                self.url,
                _one_line(e),
                self.stale_after_s,
            )

    def renew(self) -> bool:
        """Renew once (the thread's step): False, with `lost` set, when the lease is no
        longer ours. A store error is raised and leaves the lease as it was."""
        with self._lock:
            if self._holder is None or self._lost is not None:
                return False
            holder = Holder(
                self._holder.job,
                self._holder.host,
                self._holder.pid,
                self._holder.started,
                time.time(),
                self._holder.machine,
            )
            version = self._store.replace(holder.to_json().encode(), self._version)
            if version is not None:
                self._holder, self._version = holder, version
                return True
            seen = self._store.read()
            self._lost = (
                f"{self.url}: the lease of job {self.job} is gone: it was removed"
                if seen is None
                else f"{self.url}: the lease of job {self.job} is gone: it now belongs to "
                f"{self._describe(seen.holder)}"
            ) + "; another run may be writing to this output"
            self._version = None  # never remove a lease that is not ours
            return False

    def __enter__(self) -> OutputLease:
        if self._holder is None:
            self.acquire()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"ram-dist lease {self.url}", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.release()

    # -- inside -------------------------------------------------------------------------

    def _renew_loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.renew_every_s):
            try:
                if not self.renew():
                    if self._lost is not None:
                        log.error("%s", self._lost)
                    return
                last_ok = time.monotonic()
            except Exception as e:  # noqa: BLE001  (transient: try again next period)
                late = time.monotonic() - last_ok
                log.warning("%s: could not renew the lease: %s", self.url, _one_line(e))
                if late > self.stale_after_s:
                    with self._lock:
                        self._lost = (
                            f"{self.url}: the lease of job {self.job} could not be renewed "
                            f"for {late:.0f} s ({_one_line(e)}); another run may have "
                            "taken it over"
                        )
                    log.error("%s", self._lost)
                    return

    def _read_settled(self) -> _Seen | None:
        """Read the lease; a just-created one still being written is read again shortly."""
        seen = self._store.read()
        for _ in range(5):
            if seen is None or seen.holder is not None or seen.modified is None:
                break
            if time.time() - seen.modified > 1.0:
                break
            time.sleep(0.05)
            seen = self._store.read()
        return seen

    def _why_free(self, seen: _Seen) -> str | None:
        """Why a lease may be taken over (its process is gone, it is stale), or None."""
        h = seen.holder
        if h is not None and h.host == self._host and h.machine == self._machine:
            if _process_gone(h.pid, h.started):
                return "that process no longer exists"
        last = h.renewed if h is not None else seen.modified
        if last is None:
            return None  # an unreadable lease on a store that gives no time: never stale
        age = time.time() - last
        if age > self.stale_after_s:
            return f"not renewed for {age:.0f} s"
        return None

    def _describe(self, h: Holder | None) -> str:
        if h is None:
            return "an unreadable lease"
        return f"the lease of job {_clip(h.job)} on host {_clip(h.host)} (pid {h.pid})"

    def _held_message(self, seen: _Seen) -> str:
        h = seen.holder
        tail = (
            "Wait for that job to finish or stop it, then run again; --overwrite does not "
            "break a live lease."
        )
        if h is None:
            if seen.modified is None:
                when = "never on its own (this store gives no modification time)"
            else:
                when = f"from {_iso(seen.modified + self.stale_after_s)}"
            return (
                f"{self.url}: the output location is claimed by a lease ram-dist cannot read"
                + (f" (written {_iso(seen.modified)})" if seen.modified is not None else "")
                + f"; it counts as stale {when}. If no ram-dist merge writes to "
                f"{self.out_url}, delete {self.url}. " + tail
            )
        age = time.time() - h.renewed
        return (
            f"{self.url}: the output location is held by another ram-dist merge: job "
            f"{_clip(h.job)} on host {_clip(h.host)} (pid {h.pid}), started {_iso(h.started)}, "
            f"last renewed {_iso(h.renewed)} ({max(age, 0):.0f} s ago); it counts as stale "
            f"if not renewed by {_iso(h.renewed + self.stale_after_s)} "
            f"({self.stale_after_s:.0f} s after its last renewal). " + tail
        )


# -- stores ------------------------------------------------------------------------------


class _Store:
    """The conditional operations a lease needs from one kind of store."""

    def prepare(self, storage: Storage, out_url: str) -> None:
        """Make the output location able to hold the lease."""

    def create(self, data: bytes) -> Any | None:
        """Create the lease if there is none: its version, or None when one exists."""
        raise NotImplementedError

    def read(self) -> _Seen | None:
        """The lease, or None when there is none."""
        raise NotImplementedError

    def replace(self, data: bytes, version: Any) -> Any | None:
        """Write `data` if the lease is still at `version`: the new version, or None."""
        raise NotImplementedError

    def remove(self, version: Any) -> bool:
        """Delete the lease if it is still at `version`; False when it was not."""
        raise NotImplementedError

    def take_over(self, data: bytes, version: Any) -> Any | None:
        """Replace the lease at `version` (judged dead or stale) by `data`: the new version,
        or None when the lease changed first or another run won the take-over."""
        if not self.remove(version):
            return None
        return self.create(data)


def _store_for(url: str, storage: Storage) -> _Store:
    fs, path = storage.fs(url)
    if isinstance(fs, LocalFileSystem):
        return _LocalStore(path)
    if protocol_of(url) == "s3" and hasattr(fs, "call_s3") and _s3_conditional_writes():
        return _S3Store(fs, path)
    if protocol_of(url) == "s3":
        log.warning(
            "%s: this botocore does not know conditional PutObject (IfNoneMatch/IfMatch); "
            "the output lease is best effort only. Upgrade botocore/s3fs to make it exclusive.",
            url,
        )
    return _FsspecStore(fs, path)


class _LocalStore(_Store):
    """O_EXCL creates; renewals, removals and take-overs run under a guard file.

    Renaming a lease aside to take it over is not enough: a taker that judged an old lease
    stale can rename away the fresh lease another taker just created, and a third run can
    create its own in that instant (two winners; the race test saw it). So the read, check
    and write of an existing lease run while holding `GUARD_SUFFIX`, itself created with
    O_EXCL and held for milliseconds; a guard older than `GUARD_STALE_S` was left by a
    process that died holding it and is removed (two runs removing the same dead guard in
    the same instant could both go on: that takes a crash inside those milliseconds and two
    runs arriving together 10 s later)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.dir = os.path.dirname(path)
        self.guard_path = path + GUARD_SUFFIX

    def prepare(self, storage: Storage, out_url: str) -> None:
        os.makedirs(self.dir, exist_ok=True)

    def create(self, data: bytes) -> Any | None:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        try:
            _write_all(fd, data)
            return _stat_version(os.fstat(fd))
        finally:
            os.close(fd)

    def read(self) -> _Seen | None:
        return _read_local(self.path)

    def replace(self, data: bytes, version: Any) -> Any | None:
        with self._guard():
            seen = self.read()
            if seen is None or seen.version != version:
                return None
            tmp = f"{self.path}.renew-{os.getpid()}-{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                try:
                    _write_all(fd, data)
                    new = _stat_version(os.fstat(fd))
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return new

    def remove(self, version: Any) -> bool:
        with self._guard():
            return self._remove(version)

    def take_over(self, data: bytes, version: Any) -> Any | None:
        with self._guard():
            if not self._remove(version):
                return None
        return self.create(data)  # a fresh run may still win this create: it is free now

    def _remove(self, version: Any) -> bool:
        seen = self.read()
        if seen is None or seen.version != version:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Hold the guard file (waiting while another process holds it)."""
        deadline = time.monotonic() + GUARD_STALE_S + 5.0
        note = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        while True:
            try:
                fd = os.open(self.guard_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    age = time.time() - os.stat(self.guard_path).st_mtime
                except FileNotFoundError:
                    continue
                if age > GUARD_STALE_S:  # its holder died within a few milliseconds' work
                    log.warning("%s: removing a guard left %.0f s ago", self.guard_path, age)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.guard_path)
                    continue
                if time.monotonic() > deadline:
                    raise LeaseHeld(
                        f"{self.guard_path}: held by another process for {age:.0f} s"
                    ) from None
                time.sleep(0.005)
                continue
            try:
                _write_all(fd, note)
            except OSError:
                pass  # a full disk: the guard is held all the same (its note only informs)
            finally:
                os.close(fd)
            break
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.guard_path)


def _stat_version(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_local(path: str) -> _Seen | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        parts: list[bytes] = []
        size = 0
        while size <= MAX_LEASE_BYTES:
            part = os.read(fd, MAX_LEASE_BYTES + 1 - size)
            if not part:
                break
            parts.append(part)
            size += len(part)
    finally:
        os.close(fd)
    return _Seen(_parse(b"".join(parts)), st.st_mtime, _stat_version(st))


def _parse(data: bytes) -> Holder | None:
    if len(data) > MAX_LEASE_BYTES:
        return None
    try:
        return Holder.from_json(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


class _S3Store(_Store):
    """Conditional requests through s3fs's own client (`call_s3`)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One request; a 409 ConditionalRequestConflict (a concurrent conditional write
        in flight) is retried, as S3 asks."""
        for attempt in range(5):
            try:
                return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
            except Exception as e:
                if _s3_error(e) != "conflict" or attempt == 4:
                    raise
                time.sleep(0.05 * 2**attempt)
            finally:
                self.fs.invalidate_cache(self.path)
        raise AssertionError("unreachable")

    def create(self, data: bytes) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfNoneMatch="*")["ETag"]
        except Exception as e:
            if _s3_error(e) == "precondition":
                return None
            raise

    def read(self) -> _Seen | None:
        async def get() -> tuple[bytes, str, float]:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with resp["Body"] as body:
                data = await body.read(MAX_LEASE_BYTES + 1)
            return data, resp["ETag"], resp["LastModified"].timestamp()

        try:
            data, etag, modified = sync(self.fs.loop, get)
        except Exception as e:
            if _s3_error(e) == "missing":
                return None
            raise
        return _Seen(_parse(data), modified, etag)

    def replace(self, data: bytes, version: Any) -> Any | None:
        try:
            return self._call("put_object", Body=data, IfMatch=version)["ETag"]
        except Exception as e:
            if _s3_error(e) not in ("precondition", "missing"):
                raise
        # A retried request whose first try landed fails its condition: was it ours?
        seen = self.read()
        if seen is not None and seen.holder is not None and _parse(data) == seen.holder:
            return seen.version
        return None

    def take_over(self, data: bytes, version: Any) -> Any | None:
        return self.replace(data, version)  # one conditional PutObject

    def remove(self, version: Any) -> bool:
        try:
            self._call("delete_object", IfMatch=version)
            return True
        except Exception as e:
            kind = _s3_error(e)
            if kind in ("precondition", "missing"):
                return False
            if kind != "unsupported":
                raise
        # A store without conditional deletes: check, then delete (a small race).
        seen = self.read()
        if seen is None or seen.version != version:
            return False
        self._call("delete_object")
        return True


@functools.lru_cache(maxsize=1)
def _s3_conditional_writes() -> bool:
    """Whether this botocore sends PutObject's IfNoneMatch/IfMatch (s3fs silently drops
    parameters its botocore does not know)."""
    try:
        import botocore.session

        model = botocore.session.get_session().get_service_model("s3")
        members = model.operation_model("PutObject").input_shape.members
        return "IfNoneMatch" in members and "IfMatch" in members
    except Exception:  # noqa: BLE001
        return False


def _s3_error(error: BaseException) -> str | None:
    """What an s3fs/botocore error means here: "precondition" (412 PreconditionFailed),
    "conflict" (409 ConditionalRequestConflict), "missing" (404), "unsupported" (501 or a
    store refusing the conditional header), or None.

    s3fs turns a botocore `ClientError` into a builtin exception (`FileExistsError` for a
    failed `If-None-Match`, `OSError(EINVAL)` for a failed `If-Match`, `FileNotFoundError`)
    with the `ClientError` as `__cause__`; its `response` holds the code and HTTP status."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain and len(chain) < 16:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        response = getattr(e, "response", None)
        if not isinstance(response, dict):
            continue
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code == "PreconditionFailed" or status == 412:
            return "precondition"
        if code in ("ConditionalRequestConflict", "OperationAborted") or status == 409:
            return "conflict"
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return "missing"
        if code in ("NotImplemented", "InvalidArgument") or status == 501:
            return "unsupported"
        return None
    if isinstance(error, FileExistsError):
        return "precondition"
    if isinstance(error, FileNotFoundError):
        return "missing"
    return None


class _FsspecStore(_Store):
    """Best effort for stores without a conditional create: check, write, read back."""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        self.fs = fs
        self.path = path

    def prepare(self, storage: Storage, out_url: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.makedirs(self.fs._parent(self.path), exist_ok=True)

    def create(self, data: bytes) -> Any | None:
        self.fs.invalidate_cache(self.path)
        if self.fs.exists(self.path):
            return None
        self.fs.pipe_file(self.path, data)
        time.sleep(SETTLE_S)
        seen = self.read()
        return seen.version if seen is not None and seen.version == data else None

    def read(self) -> _Seen | None:
        self.fs.invalidate_cache(self.path)
        try:
            data = self.fs.cat_file(self.path, start=0, end=MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            modified: float | None = self.fs.modified(self.path).timestamp()
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001  (not every filesystem gives a time)
            modified = None
        return _Seen(_parse(data), modified, bytes(data))

    def replace(self, data: bytes, version: Any) -> Any | None:
        seen = self.read()
        if seen is None or seen.version != version:
            return None
        self.fs.pipe_file(self.path, data)
        return data

    def remove(self, version: Any) -> bool:
        seen = self.read()
        if seen is None or seen.version != version:
            return False
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            return False
        return True


# -- this host ---------------------------------------------------------------------------


def _machine_id() -> str:
    """This boot of this machine and this pid namespace (Linux), or "" where unknown."""
    parts = []
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts)


def _process_gone(pid: int, started: float) -> bool:
    """Whether process `pid` of this host no longer exists, or is a newer process that
    reused the pid of one that held a lease since `started`."""
    if pid <= 0:
        return False  # not a process id: judge the lease by its age
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    begun = _process_start(pid)
    return begun is not None and begun > started + 2.0


def _process_start(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, from /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _clip(text: str, limit: int = 200) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
