"""The lease on a local (or network) filesystem: `O_EXCL` creates, and every change of an
existing lease made while holding a guard file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fsspec import AbstractFileSystem

from ram_dist.io.lease.store import MAX_LEASE_BYTES, LeaseHeld, LeaseStore, Seen, parse

#: The guard file held while an existing lease is checked and changed, and the age at which
#: a guard counts as left by a dead process.
GUARD_SUFFIX = ".guard"
GUARD_STALE_S = 10.0

log = logging.getLogger("ram_dist.io.lease")


class LocalStore(LeaseStore):
    """O_EXCL creates; renewals, removals and take-overs run under a guard file.

    Renaming a lease aside to take it over is not enough: a taker that judged an old lease
    stale can rename away the fresh lease another taker just created, and a third run can
    create its own in that instant (two winners; the race test saw it). So the read, check
    and write of an existing lease run while holding `GUARD_SUFFIX`, itself created with
    O_EXCL and held for milliseconds; a guard older than `GUARD_STALE_S` was left by a
    process that died holding it and is removed (two runs removing the same dead guard in
    the same instant could both go on: that takes a crash inside those milliseconds and two
    runs arriving together 10 s later)."""

    def __init__(self, fs: AbstractFileSystem, path: str) -> None:
        super().__init__(fs, path)
        self.dir = os.path.dirname(path)
        self.guard_path = path + GUARD_SUFFIX

    def prepare(self) -> None:
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

    def read(self) -> Seen | None:
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


def _read_local(path: str) -> Seen | None:
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
    return Seen(parse(b"".join(parts)), st.st_mtime, _stat_version(st))
