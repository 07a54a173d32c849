"""What every sink shares: a part as a sink sees it, its receipt, a shard's digest, the
target a worker writes to and the driver's side of a shard; `choose_sink` picks the sink of
an output location's backend (`backends`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ram_dist.io.backends import backend_of, load
from ram_dist.io.storage import Storage

if TYPE_CHECKING:
    from ram_dist.io.sinks.driver import OrderedWriter

DIRECT = "direct"
THROUGH_DRIVER = "through-driver"


class Part(Protocol):
    """What a sink needs of a part (the planner's `planning.units.Part`): bytes [start, stop) of a
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

    @classmethod
    def of(
        cls, part: Part, sha256: str, etag: str | None = None, data: np.ndarray | None = None
    ) -> PartReceipt:
        """The receipt of `part` (its digest `sha256`, hex)."""
        return cls(part.shard, part.number, part.start, part.stop, sha256, etag, data)

    @classmethod
    def recorded(cls, shard: str, number: int, rec: dict[str, Any]) -> PartReceipt:
        """The receipt of a part the manifest recorded (`record`'s entry)."""
        return cls(shard, number, rec["start"], rec["stop"], rec["sha256"], rec.get("etag"))

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
class StoreTarget(ShardTarget):
    """A shard in an object store, shipped to the workers with the storage options (the
    client is built on the worker)."""

    url: str
    storage: Storage

    def fs(self) -> Any:
        """The store's filesystem on this process (`Storage.fs`)."""
        return self.storage.fs(self.url)[0]


@dataclass(frozen=True)
class KeptTarget(ShardTarget):
    """A part one output already holds (a resumed sweep's variant kept it) while another
    output needs the same part made: its bytes are made with the others' and dropped, and
    the part in place is neither written again nor touched."""

    url: str

    def write(self, part: Part, data: np.ndarray, sha256: bytes) -> PartReceipt:
        return PartReceipt.of(part, sha256.hex())


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
    writer: OrderedWriter | None = None


class OutputSink:
    """Runs on the driver: opens, completes and aborts shards of one output location."""

    path: str = DIRECT
    min_part_bytes: int = 0
    """The smallest part the store takes (all but a shard's last)."""
    chosen: str = ""
    """Why this sink writes there, in words, where any location of its store takes it (then
    `choose` needs no override)."""

    def __init__(self, out_url: str, storage: Storage, reason: str) -> None:
        self.out_url = out_url
        self.storage = storage
        self.reason = reason
        self.bytes_written_by_driver = 0

    @classmethod
    def choose(
        cls, out_url: str, storage: Storage, *, shared: bool, single_node: bool | None
    ) -> OutputSink:
        """The sink of this kind for `out_url`, or the one to use instead (see `choose_sink`);
        by default this kind, for the reason `chosen` gives."""
        if not cls.chosen:
            raise NotImplementedError(f"{cls.__name__} says neither `chosen` nor `choose`")
        return cls(out_url, storage, cls.chosen)

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


def plan_record(plan: list[Part]) -> list[list[int]]:
    """How the manifest records the way a shard was cut: each part's [start, stop)."""
    return [[p.start, p.stop] for p in plan]


def kept_parts(plan: list[Part], old: dict[str, Any] | None) -> dict[int, dict[str, Any]] | None:
    """The recorded parts of an unfinished write (`old`, the manifest's record of it), by
    number, when it was cut the same way as now; None when there is none or it was cut
    otherwise (then nothing of it is kept)."""
    if not old or old.get("plan") != plan_record(plan):
        return None
    return {int(n): rec for n, rec in (old.get("parts") or {}).items()}


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
