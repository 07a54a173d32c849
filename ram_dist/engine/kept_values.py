"""A LoRA task's values kept from the pass that formed them for the passes after it, on the
node that formed them, so that each adapter's product is formed once per element per job
where that pays.

A LoRA task's values (`planning.lora_sources`: the base plus the adapter's rank-r product,
at the task's dtype) are needed by every reduce round that reads the tensor (the first one's
NaN/Inf check included) and by the map pass. Keeping them costs a write to shared memory in
the first pass and a read in each later one; forming them again costs the product in each
later pass. With one later pass (a method of one reduce round, RAM+'s: the map pass),
keeping them was not reliably faster at rank 16 and 64 (`benchmarks/RESULTS.md`), and it
holds the values in the node's memory: a job keeps them only where at least
`MIN_LATER_READS` passes read them after the first (TIES's three later rounds and map pass,
where keeping them measured faster). The first pass to form a block's values writes them,
as the task's dtype (2 bytes an element in bfloat16), to a file in shared memory
(`/dev/shm`, else the temp folder) named by the job's token, the tensor, the block and the
task; a later pass that reads the same block takes them from there instead of forming the
product again. The map pass, the last reader, deletes each file as it reads it.

Why files in node-local shared memory, and not Ray's object store or a worker's own memory:
a pass's tasks are plain Ray tasks, so a unit's map task may run in another worker process
than its reduce task, and only a file every process of the node sees is found there; the
driver already sends a part's map task back to the node that read its units first
(`engine.passes`), where the files are. Putting the values in Ray's object store would find
them from any node, but every reduce task would return references the driver holds until
the map pass, owned by worker processes Ray may stop meanwhile, and the store's memory
would hold them besides: no cheaper, and lost with their owner. A block not found (another
node, a budget that had no room, a file that could not be written) is formed again: the
bytes are the same either way, since the values are a function of the inputs and the block
alone, as `kernels.lora` fixes them.

The bytes kept on a node are bounded by the job's budget (`KeptValues.budget_bytes`, at
most `MEMORY_SHARE` of the node's memory) and leave at least `RESERVE_FRACTION` of the
shared-memory filesystem free; a block that does not fit is simply not kept. The count is
one file per node and job (`.used`), changed under a lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ram_dist.dtypes import itemsize

if TYPE_CHECKING:
    from ram_dist.planning.job import Job

#: The share of a node's memory a job's kept values may take at most.
MEMORY_SHARE = 0.25
#: The share of the shared-memory filesystem always left free.
RESERVE_FRACTION = 0.10
#: Where the values are kept: shared memory where the system has it.
SHM = "/dev/shm"
#: The least number of passes after the first that may read a LoRA task's values (the
#: job's reduce rounds after the first, and its map pass) for them to be kept.
MIN_LATER_READS = 2


@dataclass
class ProductCount:
    """Elements of LoRA task values a task formed (the product computed) and took as kept."""

    formed: int = 0
    reused: int = 0


@dataclass(frozen=True)
class KeptValues:
    """Where one job keeps its LoRA task values (picklable, shipped to the workers with the
    pass's flags): the job's `token` names its folder on every node; `budget_bytes` bounds
    what a node keeps; `last_reader` (the map pass) deletes each file once read."""

    token: str
    budget_bytes: int
    base_dir: str | None = None
    """Parent of the job's folder; None: `SHM` (else the temp folder)."""
    last_reader: bool = False

    def for_last_pass(self) -> KeptValues:
        return replace(self, last_reader=True)

    def root(self) -> str:
        parent = self.base_dir
        if parent is None:
            parent = SHM if os.path.isdir(SHM) else tempfile.gettempdir()
        return os.path.join(parent, f"ram-dist-kept-{os.getuid()}", self.token)

    def take(self, key: tuple[str, int, int, int], into: np.ndarray) -> np.ndarray | None:
        """The kept values of `key` (tensor, block start, block stop, input) read into the
        byte array `into`, as bytes over it; None when none are kept here."""
        if not _private(os.path.dirname(self.root())):
            return None
        path = os.path.join(self.root(), _file_name(key))
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                got = f.readinto(memoryview(into[:size]))
        except (OSError, ValueError):
            return None
        if got != size:
            return None
        if self.last_reader:
            with contextlib.suppress(OSError):
                os.unlink(path)
                self._count(-size)
        return into[:size]

    def keep(self, key: tuple[str, int, int, int], values: np.ndarray) -> bool:
        """Keep `values` (bytes) under `key` when the budget and the filesystem have room;
        whether they were kept. A file appears whole (written aside, then renamed)."""
        if self.last_reader:
            return False  # nobody reads it again
        root = self.root()
        try:
            for folder in (os.path.dirname(root), root):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(folder, 0o700)
            if not _private(os.path.dirname(root)):
                return False  # another user's folder: never read nor written
            path = os.path.join(root, _file_name(key))
            if os.path.exists(path) or not self._room(root, values.size):
                return False
            fd, aside = tempfile.mkstemp(dir=root, prefix=".part-")
        except OSError:
            return False
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                f.write(memoryview(values))
            os.replace(aside, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(aside)
            self._count(-values.size)
            return False
        return True

    def remove(self) -> int:
        """Delete this job's folder on this node (the driver runs it on every node when the
        job ends); the bytes it still held."""
        root = self.root()
        held = sum(
            e.stat().st_size for e in os.scandir(root) if e.is_file() and e.name != ".used"
        ) if os.path.isdir(root) else 0  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
        return held

    def _room(self, root: str, nbytes: int) -> bool:
        """Count `nbytes` against the node's budget when they fit in it and leave the
        filesystem's reserve free; whether they did."""
        stat = os.statvfs(root)
        if (stat.f_bavail - stat.f_blocks * RESERVE_FRACTION) * stat.f_frsize < nbytes:
            return False
        limit = min(self.budget_bytes, int(MEMORY_SHARE * _node_memory()))
        return self._count(nbytes, limit)

    def _count(self, nbytes: int, limit: int | None = None) -> bool:
        """Add `nbytes` to the node's count under its lock, unless that passes `limit`."""
        with open(os.path.join(self.root(), ".used"), "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            used = int(f.read() or b"0")
            if limit is not None and used + nbytes > limit:
                return False
            f.seek(0)
            f.truncate()
            f.write(str(max(0, used + nbytes)).encode())
            return True


def kept_for(job: Job, budget_bytes: int | None = None) -> KeptValues | None:
    """Where a job keeps its LoRA task values: None where fewer than `MIN_LATER_READS`
    passes read them after the one that forms them (its reduce rounds after the first, its
    map pass: one for a method of one round), or none is worth keeping (`costly`);
    `budget_bytes` per node (None: all of them, within `MEMORY_SHARE` of each node's
    memory)."""
    if job.reduce_rounds < MIN_LATER_READS:
        return None
    total = sum(
        entry.numel * itemsize(src.values_dtype)
        for entry in job.layout.tensors.values()
        if entry.participating
        for src in entry.sources[1:]
        if src.costly
    )
    if total == 0:
        return None
    return KeptValues(uuid.uuid4().hex, total if budget_bytes is None else budget_bytes)


def _private(folder: str) -> bool:
    """A real folder of this user that nobody else may write to (a shared `/dev/shm` lets
    anyone make a folder of any name: one made by another user is not trusted)."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _file_name(key: tuple[str, int, int, int]) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _node_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
