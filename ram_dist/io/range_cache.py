"""What the first pass fetched, kept on node-local disk so that later passes read it there.

Every pass of a merge walks the same work units with the same compute blocks, so the exact
byte ranges `(url, start, end)` the first reduce round reads come back in every later round
and in the map pass. For inputs on object storage, keeping those ranges on the worker's own
disk makes each remote byte cross the network once; the driver sends a unit back to the node
that read it first (see `engine.passes`).

A kept range is a file named by a hash of `(url, start, end)`, in a folder named by a hash
of the job's input identity (sizes, header hashes, ETags or mtimes) and the output, plus the
node's boot id: a changed input never hits a stale file, a re-run of a killed job reuses what
it left, and bytes never flushed before a node crashed are never read. Files appear by rename,
so no reader sees a partial one. The cache never decides a byte of the result: anything not
found, unreadable or not kept (a disk within its reserve) is simply fetched again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

#: Free space left alone on the cache's disk: this share of the disk, and at least
#: `RESERVE_MIN_BYTES`.
RESERVE_FRACTION = 0.10
RESERVE_MIN_BYTES = 1 << 30
#: A function that reads ranges into the given buffers, bypassing the cache.
Fetch = Callable[[list[tuple[str, int, int]], list[memoryview]], Any]


@dataclass(frozen=True)
class CacheTraffic:
    """Bytes one unit read from the cache and wrote to it."""

    read: int = 0
    written: int = 0


class Traffic:
    """Counts a task's cache traffic as its reads happen (the read-ahead thread included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read = 0
        self._written = 0

    def add(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self._read += read
            self._written += written

    def total(self) -> CacheTraffic:
        with self._lock:
            return CacheTraffic(self._read, self._written)


@dataclass(frozen=True)
class InputCache:
    """Where and how a pass keeps input ranges; picklable, shipped to the workers in `Storage`."""

    job_key: str
    """A short hash of the job's input identity and output: the folder's name."""
    local_inputs: bool = False
    """Keep ranges of local files too (`--input-cache on`); else only remote ones."""
    base_dir: str | None = None
    """Parent of the job's folder; None: `<temp dir>/ram-dist-cache-<uid>` of each node."""
    last_reader: bool = False
    """The map pass: a hit is deleted once read, and a miss is not kept (nobody reads it again)."""
    reserve_fraction: float = RESERVE_FRACTION
    reserve_min_bytes: int = RESERVE_MIN_BYTES

    def for_last_pass(self) -> InputCache:
        return replace(self, last_reader=True)

    def parent(self) -> str:
        """The folder holding job folders, resolved on the node that asks."""
        if self.base_dir is not None:
            return self.base_dir
        return os.path.join(tempfile.gettempdir(), f"ram-dist-cache-{_uid()}")

    def root(self) -> str:
        """This job's folder on this node (this boot of it)."""
        return os.path.join(self.parent(), f"{self.job_key}-{_boot_id()}")

    def covers(self, url: str, is_local: Callable[[str], bool]) -> bool:
        return self.local_inputs or not is_local(url)

    def read(
        self,
        url_ranges: list[tuple[str, int, int]],
        buffers: list[memoryview],
        fetch: Fetch,
        is_local: Callable[[str], bool],
        traffic: Traffic | None = None,
    ) -> None:
        """Fill `buffers[i]` with range i: from the cache where it holds the range, the rest
        through `fetch` (which retries), keeping what was fetched unless this is the last pass.
        `traffic` counts the bytes read from the cache and written to it."""
        traffic = traffic if traffic is not None else Traffic()
        root = self._usable_root()
        kept: dict[int, str] = {}
        if root is not None:
            for i, (url, start, end) in enumerate(url_ranges):
                if end > start and self.covers(url, is_local):
                    kept[i] = os.path.join(root, _file_name(url, start, end))
        misses = []
        for i in range(len(url_ranges)):
            if i in kept and _load(kept[i], buffers[i]):
                traffic.add(read=len(buffers[i]))
                if self.last_reader:
                    _unlink(kept[i])
            else:
                misses.append(i)
        if not misses:
            return
        fetch([url_ranges[i] for i in misses], [buffers[i] for i in misses])
        if self.last_reader:
            return
        for i in misses:
            if i in kept and self._store(kept[i], buffers[i]):
                traffic.add(written=len(buffers[i]))

    def remove(self) -> int:
        """Delete this job's folders on this node (any boot); returns how many were removed."""
        parent = self.parent()
        try:
            names = [n for n in os.listdir(parent) if n.startswith(f"{self.job_key}-")]
        except OSError:
            return 0
        for name in names:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        return len(names)

    def _usable_root(self) -> str | None:
        """The job's folder, created private to this user; None when it cannot be trusted
        (another user owns it or may write to it: their files would become our inputs)."""
        root = self.root()
        try:
            os.makedirs(self.parent(), mode=0o700, exist_ok=True)
            os.makedirs(root, mode=0o700, exist_ok=True)
            checked = [root] if self.base_dir is not None else [root, self.parent()]
            if all(_private(os.lstat(path)) for path in checked):
                return root
        except OSError:
            pass
        return None

    def _store(self, path: str, buf: memoryview) -> bool:
        """Keep `buf` at `path` (temp name, then rename) if the disk stays above its reserve."""
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.partial"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            if not self._has_room(path, len(buf)):
                return False
            with open(tmp, "wb", buffering=0) as f:
                done = 0
                while done < len(buf):
                    done += f.write(buf[done:]) or 0
            os.replace(tmp, path)
            return True
        except OSError:  # a full or vanished disk means no caching, never an error
            _unlink(tmp)
            return False

    def _has_room(self, path: str, nbytes: int) -> bool:
        folder = os.path.dirname(path)
        return room_above_reserve(folder, self.reserve_fraction, self.reserve_min_bytes) >= nbytes


def room_above_reserve(
    folder: str, fraction: float = RESERVE_FRACTION, min_bytes: int = RESERVE_MIN_BYTES
) -> float:
    """Bytes the cache may still keep on the disk of `folder` (negative: the disk is already
    within its reserve, and nothing is kept); tests that need kept bytes skip by it."""
    usage = shutil.disk_usage(folder)
    return usage.free - max(min_bytes, fraction * usage.total)


def job_key(identity: str) -> str:
    """A short, stable folder name for a job's inputs and output."""
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def _file_name(url: str, start: int, end: int) -> str:
    digest = hashlib.sha256(f"{url}\0{start}\0{end}".encode()).hexdigest()
    return os.path.join(digest[:2], digest[2:40])


def _load(path: str, buf: memoryview) -> bool:
    """Read a kept range into `buf`; False (a miss) unless the whole file is there."""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != len(buf):
                return False
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    return False
                done += n
            return True
    except OSError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _private(st: os.stat_result) -> bool:
    """A real folder of this user that nobody else may write to."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == _uid() and not st.st_mode & 0o022


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


_BOOT_ID: list[str] = []


def _boot_id() -> str:
    """This node's boot (Linux); files written before a crash are never read after it."""
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _BOOT_ID.append(f.read().strip().replace("-", "")[:12])
        except OSError:
            _BOOT_ID.append("0")
    return _BOOT_ID[0]
