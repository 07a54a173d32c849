"""What the passes of one job share, as objects: the job and where it runs (`PassContext`),
what the map pass makes and where it goes (`MapOutput`), the job's layout and parameters in
Ray's object store (`Shipped`), and its output parts (`PartPlan`, made once per job and part
size, and kept by the job's context only: nothing outlives the job). Driver side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ram_dist.engine.gpu import Devices
from ram_dist.engine.kept_values import KeptValues
from ram_dist.engine.pool import Shared
from ram_dist.engine.progress import Progress
from ram_dist.engine.runtime import Cluster
from ram_dist.engine.shard_book import ShardBook
from ram_dist.engine.worker import TaskContext, WorkFlags
from ram_dist.io.range_cache import InputCache
from ram_dist.io.sinks import OutputSink
from ram_dist.io.storage import Storage
from ram_dist.io.writer import shard_header
from ram_dist.methods import MergeMethod
from ram_dist.methods.protocol import State
from ram_dist.planning.job import Job
from ram_dist.planning.layout import unit_out_bytes
from ram_dist.planning.units import Part, WorkUnit, plan_parts


@dataclass(frozen=True)
class Shipped:
    """What every task of a job reads that is the same for all of them, the layout and the
    parameters of every tensor, put in Ray's object store once for all passes: each worker
    process deserializes them once (`pool.Shared`), not with every task."""

    layout: Shared
    params: Shared

    @classmethod
    def of(cls, job: Job) -> Shipped:
        return cls(Shared(job.layout), Shared(job.params))

    def context(
        self, storage: Storage, method: MergeMethod, state: State, flags: WorkFlags
    ) -> TaskContext:
        """A pass's `TaskContext` as it is shipped: the layout and the parameters by
        reference, which each worker process resolves once (`pool.Shared`)."""
        return TaskContext(self.layout, storage, method, self.params, state, flags)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PartPlan:
    """The job's output parts for one least part size: its units by index, each shard's
    header (each holds every tensor of its shard: seconds to make for 100k tensors) and each
    shard's parts (`plan_parts`)."""

    units: dict[int, WorkUnit]
    headers: dict[str, bytes]
    parts: dict[str, list[Part]]

    @classmethod
    def of(cls, job: Job, min_part_bytes: int) -> PartPlan:
        units = {u.index: u for u in job.units}
        headers = {s: shard_header(job.layout.out_tensors(s)) for s in job.layout.shards}
        sizes = {i: unit_out_bytes(u, job.layout) for i, u in units.items()}
        parts: dict[str, list[Part]] = {s: [] for s in job.layout.shards}
        lengths = {s: len(h) for s, h in headers.items()}
        for part in plan_parts(list(units.values()), sizes, lengths, min_part_bytes):
            parts[part.shard].append(part)
        return cls(units, headers, parts)

    def of_shards(
        self, shards: Sequence[str]
    ) -> tuple[dict[int, WorkUnit], dict[str, bytes], dict[str, list[Part]]]:
        """The units of `shards` by index, each shard's header, and its parts: fresh
        containers (the caller may change them)."""
        wanted = set(shards)
        units = {i: u for i, u in self.units.items() if u.shard in wanted}
        return units, {s: self.headers[s] for s in shards}, {s: list(self.parts[s]) for s in shards}

    def unit_groups(self) -> list[tuple[WorkUnit, ...]]:
        """The units of each output part the map pass will make, in order: a reduce task
        reads one group, so that with an input cache the part's task finds all its bytes on
        one node. Parts are single units unless units are smaller than a part must be."""
        return [
            tuple(self.units[i] for i in p.units) for ps in self.parts.values() for p in ps
            if p.units
        ]  # fmt: skip


@dataclass(frozen=True)
class PassContext:
    """What the passes of one job share: the job and the cluster it runs on; the job's
    `devices` (None: each pass opens its own); its layout and parameters already in the
    object store (None: each pass ships its own); where progress goes (None: a fresh
    `Progress` per pass); the input cache (None: none); and the least size of an output
    part, as the map pass's sink asks (the reduce pass reads the units of one part together,
    `PartPlan.unit_groups`); and where the passes keep LoRA task values for the passes after
    the one that formed them (`engine.kept_values`; None: every pass forms them)."""

    job: Job
    cluster: Cluster
    devices: Devices | None = None
    shipped: Shipped | None = None
    progress: Progress | None = None
    cache: InputCache | None = None
    min_part_bytes: int = 0
    kept: KeptValues | None = None
    _plans: dict[int, PartPlan] = field(default_factory=dict, repr=False, compare=False)

    def part_plan(self, min_part_bytes: int | None = None) -> PartPlan:
        """The job's `PartPlan` for `min_part_bytes` (default: this context's), made once
        for all the passes of this context."""
        size = self.min_part_bytes if min_part_bytes is None else min_part_bytes
        if size not in self._plans:
            self._plans[size] = PartPlan.of(self.job, size)
        return self._plans[size]


@dataclass(frozen=True)
class MapOutput:
    """What a map pass makes and where it goes: the `shards` to make, the `sink` their parts
    are written through, and the `book` that records each shard once complete. A part runs
    on its first unit's `first_node` (the node whose input cache holds its bytes) while that
    node lives, or, with `pin_to`, on that node only; with `backward`, the last shard's last
    part goes first (`PassStats.backward`)."""

    shards: list[str]
    sink: OutputSink
    book: ShardBook
    first_node: dict[int, str] = field(default_factory=dict)
    pin_to: str | None = None
    backward: bool = False
    also: tuple[tuple[OutputSink, ShardBook], ...] = ()
    """Further outputs made from the same reads, each part once for all (a sweep's other
    variants: the job's method makes one output each, `outputs`); each resumes from its own
    book's manifest (the shards it finished, the parts it holds), as the first does."""
