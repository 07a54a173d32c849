"""The output lease itself: claim, renew, judge and release, whatever the store (the store's
own conditional operations are in `local`, `s3` and `best_effort`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from types import TracebackType
from typing import Any

from ram_dist.errors import RamDistError
from ram_dist.io.backends import backend_of, load
from ram_dist.io.failures import explained, is_storage_failure
from ram_dist.io.lease.host import machine_id, process_gone
from ram_dist.io.lease.store import Holder, LeaseHeld, LeaseStore, Seen
from ram_dist.io.names import LEASE_NAME
from ram_dist.io.storage import Storage, join

#: A lease not renewed for this long may be taken over.
STALE_AFTER_S = 120.0
RENEW_EVERY_S = 20.0
#: Rounds of create / judge / take over before giving up on a contended location.
ATTEMPTS = 8

log = logging.getLogger("ram_dist.io.lease")


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
        self._store = _store_for(self.url, storage)
        self._host = socket.gethostname()
        self._machine = machine_id()
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

    @contextlib.contextmanager
    def naming_a_live_holder(self) -> Iterator[None]:
        """Checks run before the claim, and refused, are answered with `LeaseHeld` when a
        live run holds the location: the files it is writing there are not yet a model
        (nor its model), and the run's name says more than their state. Reads only."""
        try:
            yield
        except LeaseHeld:
            raise
        except RamDistError:
            try:
                seen = self._read_settled()
            except Exception as e:  # noqa: BLE001  (the refusal stands on its own)
                log.debug("%s: could not read the lease: %s", self.url, _one_line(e))
                seen = None
            if seen is not None and self._why_free(seen) is None:
                raise LeaseHeld(self._held_message(seen)) from None
            raise

    def _acquire(self) -> str | None:
        self._store.prepare()
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

    def _read_settled(self) -> Seen | None:
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

    def _why_free(self, seen: Seen) -> str | None:
        """Why a lease may be taken over (its process is gone, it is stale), or None."""
        h = seen.holder
        if h is not None and h.host == self._host and h.machine == self._machine:
            if process_gone(h.pid, h.started):
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

    def _held_message(self, seen: Seen) -> str:
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


def _store_for(url: str, storage: Storage) -> LeaseStore:
    fs, path = storage.fs(url)
    return load(backend_of(url).lease).for_location(url, fs, path)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _clip(text: str, limit: int = 200) -> str:
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
