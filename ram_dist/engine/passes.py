"""The two passes over the work units, run from the driver on Ray.

The reduce pass sums int64 statistics (order and chunking cannot change a sum of integers);
the map pass appends merged bytes to the shard they belong to and publishes each shard when
it is whole, telling the caller so it can record the shard in the manifest. With an input
cache, the first round to read a unit records its node, and every later read of that unit
is sent back there, where the cache holds its bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ram_dist.engine import memory
from ram_dist.engine.job import Job
from ram_dist.engine.pool import near, ordered_map
from ram_dist.engine.progress import Progress
from ram_dist.engine.runtime import Cluster
from ram_dist.engine.work import UnitResult, map_unit, reduce_unit
from ram_dist.errors import RamDistError
from ram_dist.io.range_cache import CacheTraffic, InputCache, counted
from ram_dist.io.storage import Storage
from ram_dist.io.writer import ShardWriter
from ram_dist.plan import WorkUnit

#: Ray re-runs a unit whose worker or node died this many times; a unit that raised is not
#: re-run (bad data fails the same way twice).
SYSTEM_RETRIES = 5


@dataclass
class PassStats:
    """Counters of one pass, for the report."""

    units: int = 0
    wall_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    max_unit_bytes_read: list[int] = field(default_factory=list)
    worker_peak_rss_bytes: int = 0
    worker_peak_private_bytes: int = 0
    fused_elements: int = 0
    cache_bytes_read: int = 0
    cache_bytes_written: int = 0
    units_per_node: dict[str, int] = field(default_factory=dict)
    units_sent_back: int = 0
    """Units sent to the node that read them first (where the cache holds their bytes)."""
    units_ran_there: int = 0
    first_node: dict[int, str] = field(default_factory=dict)
    """Per unit index, the node that first read it (not reported)."""

    def ran(self, index: int, node: str, traffic: CacheTraffic, sent_to: str | None) -> None:
        """Where a unit ran, and what it read from and wrote to the cache there."""
        self.cache_bytes_read += traffic.read
        self.cache_bytes_written += traffic.written
        self.units_per_node[node] = self.units_per_node.get(node, 0) + 1
        self.first_node.setdefault(index, node)
        if sent_to is not None:
            self.units_sent_back += 1
            self.units_ran_there += node == sent_to

    def add(self, result: UnitResult) -> None:
        bytes_read = result.bytes_read
        self.units += 1
        self.fused_elements += result.fused_elements
        self.bytes_read += sum(bytes_read)
        if not self.max_unit_bytes_read:
            self.max_unit_bytes_read = [0] * len(bytes_read)
        self.max_unit_bytes_read = [
            max(a, b) for a, b in zip(self.max_unit_bytes_read, bytes_read, strict=True)
        ]
        self.worker_peak_rss_bytes = max(self.worker_peak_rss_bytes, result.peak_rss_bytes)
        self.worker_peak_private_bytes = max(
            self.worker_peak_private_bytes, result.peak_private_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "wall_s": round(self.wall_s, 4),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "max_unit_bytes_read_per_input": self.max_unit_bytes_read,
            "fused_elements": self.fused_elements,
            "bytes_fetched": self.bytes_read - self.cache_bytes_read,
            "cache_bytes_read": self.cache_bytes_read,
            "cache_bytes_written": self.cache_bytes_written,
            "units_per_node": dict(self.units_per_node),
            "units_sent_back": self.units_sent_back,
            "units_ran_there": self.units_ran_there,
        }


def _options(job: Job, cluster: Cluster) -> tuple[int, dict[str, Any]]:
    """Units in flight, and the Ray options of each. With `--workers`, exactly that many run
    at once; by default twice the cluster's CPUs (or GPUs) are submitted, Ray runs as many as
    it has cores for, and the rest are queued so that a worker never waits on the driver."""
    slots = cluster.gpus or cluster.cpus
    in_flight = job.config.workers or 2 * slots
    resources: dict[str, Any] = {"num_cpus": 1, "max_retries": SYSTEM_RETRIES}
    if cluster.gpus:
        resources["num_gpus"] = 1
    return in_flight, resources


def _placement(
    storage: Storage, cache: InputCache | None, first_node: dict[int, str]
) -> tuple[Storage, Callable[[WorkUnit], str | None]]:
    """The storage a pass's workers read through (with the cache, if any), and the node
    each unit should run on: the one that read it first, when a cache may hold its bytes."""
    if cache is None:
        return storage, lambda unit: None
    return replace(storage, cache=cache), lambda unit: first_node.get(unit.index)


class WriteBehind:
    """Appends merged bytes to the open shard in a thread (hashing and file or upload writes
    release the GIL), so the driver goes on collecting results and submitting units. At most
    `depth` appends wait; `drain` before a shard is committed."""

    def __init__(self, depth: int = 4) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ram-dist-write")
        self._pending: deque[Future[None]] = deque()
        self._depth = depth

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Stop: appends not yet started are dropped (the caller discards the shard)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


def reduce_pass(
    job: Job, cluster: Cluster, progress: Progress | None = None, cache: InputCache | None = None
) -> tuple[dict[str, Any], PassStats]:
    """Every reduce round of the method: sum each unit's int64 statistics per key, then let
    the method fold the sums into its state. Rounds no tensor needs read nothing. The first
    round also counts NaN and Inf in every input (a check-only round for methods without
    statistics), unless the job allows them. With a `cache`, what a round fetches is kept on
    its node, and `stats.first_node` says which node first read each unit."""
    stats = PassStats()
    storage, node_of = _placement(job.storage, cache, stats.first_node)
    start = time.perf_counter()
    method, state = job.method, job.initial_state()
    workers, resources = _options(job, cluster)
    numel = job.numel()
    check = not job.config.allow_nonfinite
    for round_ in range(max(method.rounds, 1 if check else 0)):
        checking = check and round_ == 0
        active = {
            n for n in job.params if round_ < method.rounds and method.active(round_, state, n)
        }
        wanted = set(job.params) if checking else active
        units = [u for u in job.units if any(p.tensor in wanted for p in u.pieces)]
        if not units:
            continue
        totals: dict[str, torch.Tensor] = {}
        nonfinite: dict[str, list[int]] = {}
        shipped = {**state, "fused": job.config.kernels == "auto"}
        shared = (job.layout, storage, method, job.params, shipped, round_, checking)
        fn = partial(counted, reduce_unit)
        results = ordered_map(fn, units, shared, workers, resources, lambda u: near(node_of(u)))
        progress = progress or Progress()
        total_bytes = sum(job.unit_bytes(u, wanted) for u in units)
        progress.start_pass(f"reduce {round_ + 1}", total_bytes, len(units))
        for unit, (node, (result, traffic)) in zip(units, results, strict=True):
            stats.ran(unit.index, node, traffic, node_of(unit))
            progress.advance(sum(result.bytes_read))
            for key, value in (result.stats or {}).items():
                totals[key] = totals[key] + value if key in totals else value
            for name, counts in (result.nonfinite or {}).items():
                old = nonfinite.get(name, [0] * len(counts))
                nonfinite[name] = [a + b for a, b in zip(old, counts, strict=True)]
            stats.add(result)
        progress.end_pass()
        if nonfinite:
            raise _nonfinite_error(job, nonfinite)
        if round_ < method.rounds:
            state = method.finalize(round_, totals, job.params, numel, state)
    stats.wall_s = time.perf_counter() - start
    return state, stats


def _nonfinite_error(job: Job, found: dict[str, list[int]]) -> RamDistError:
    lines = []
    inputs = [job.base, *job.tasks]
    for name, counts in sorted(found.items()):
        for ckpt, count in zip(inputs, counts, strict=True):
            if count:
                lines.append(f"tensor {name!r}: {count} NaN/Inf in {ckpt.describe(name)}")
    shown = "; ".join(lines[:10]) + (f"; and {len(lines) - 10} more" if len(lines) > 10 else "")
    return RamDistError(
        f"non-finite values in the inputs: {shown}. Fix the checkpoint, or pass "
        "--allow-nonfinite to merge them as the rule computes them"
    )


def map_pass(
    job: Job,
    cluster: Cluster,
    state: dict[str, Any],
    units: list[WorkUnit],
    on_shard: Callable[[str, str, int], None],
    progress: Progress | None = None,
    cache: InputCache | None = None,
    first_node: dict[int, str] | None = None,
) -> PassStats:
    """Merge `units` in order; each shard is published when whole, then `on_shard(name,
    sha256, size)` is called. With a `cache`, the last reader of it, a unit runs on its
    `first_node` (while that node lives) and removes what it reads from the cache there."""
    assert job.out is not None
    stats = PassStats()
    last = cache.for_last_pass() if cache is not None else None
    storage, node_of = _placement(job.storage, last, first_node or {})
    start = time.perf_counter()
    writer: ShardWriter | None = None
    shard = ""
    workers, resources = _options(job, cluster)
    shipped = {**state, "fused": job.config.kernels == "auto"}
    shared = (job.layout, storage, job.method, job.params, shipped)
    fn = partial(counted, partial(map_unit, reuse_output=True))  # Ray copies each result out
    results = ordered_map(fn, units, shared, workers, resources, lambda u: near(node_of(u)))

    progress = progress or Progress()
    progress.start_pass("map", sum(job.unit_bytes(u) for u in units), len(units))

    behind = WriteBehind()

    def publish() -> None:
        assert writer is not None
        behind.drain()
        writer.commit()
        stats.bytes_written += writer.written
        on_shard(shard, writer.sha256, writer.written)
        progress.event("shard_written", shard=shard, bytes=writer.written, sha256=writer.sha256)

    try:
        for unit, (node, (result, traffic)) in zip(units, results, strict=True):
            stats.ran(unit.index, node, traffic, node_of(unit))
            progress.advance(sum(result.bytes_read))
            if writer is None or unit.shard != shard:
                if writer is not None:
                    publish()
                shard = unit.shard
                tensors = job.layout.out_tensors(shard)
                writer = ShardWriter(job.out, shard, tensors, job.storage)
            behind.submit(writer.write, memoryview(result.data))
            stats.add(result)
            memory.note()  # the driver, holding this result
        if writer is not None:
            publish()
            writer = None
    except BaseException:
        behind.close()
        if writer is not None:
            writer.discard()
        raise
    behind.close()
    progress.end_pass(bytes_written=stats.bytes_written)
    stats.wall_s = time.perf_counter() - start
    return stats
