"""The two passes over the work units, run from the driver on Ray.

Both take results as they finish. The reduce pass sums int64 statistics (order and unit boundaries
cannot change a sum of integers); the map pass has each task write its part of a shard
through the output sink (no data byte reaches the driver, except on the through-driver
fallback) and completes each shard when all its parts are in, recording it. With an input
cache, the first round to read a unit records its node, and every later read of that unit
is sent back there, where the cache holds its bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from ram_dist import kernels
from ram_dist.dtypes import dtype_name, itemsize
from ram_dist.engine import preload
from ram_dist.engine.gpu import Devices, job_devices
from ram_dist.engine.kept_values import KeptValues
from ram_dist.engine.map_step import PartWork, map_part
from ram_dist.engine.pass_context import MapOutput, PassContext, Shipped
from ram_dist.engine.pass_stats import PassStats
from ram_dist.engine.pool import Batching, Place, Routing, near, on_every_node, unordered_map
from ram_dist.engine.progress import Progress
from ram_dist.engine.reduce_step import add_up, reduce_group
from ram_dist.engine.unit_results import PrecisionCounts
from ram_dist.engine.worker import WorkFlags
from ram_dist.errors import RamDistError
from ram_dist.io.range_cache import InputCache
from ram_dist.io.sinks import KeptTarget, OpenShard, plan_record
from ram_dist.io.storage import Storage, join
from ram_dist.methods.protocol import RoundTotals
from ram_dist.planning.devices import DeviceChoice
from ram_dist.planning.job import Job
from ram_dist.planning.units import Part, WorkUnit, parts_as_recorded

#: Ray re-runs a unit whose worker or node died this many times; a unit that raised is not
#: re-run (bad data fails the same way twice).
SYSTEM_RETRIES = 5


#: A Ray task of a pass reads at least this many input bytes (`pool.Batching`): a task costs
#: the driver and its worker milliseconds, which a unit this small takes to read and merge.
TASK_BYTES = 8 * 2**20
#: ... or at least 1/TASKS_PER_SLOT of the pass's bytes over its tasks in flight, where that is
#: less: every worker still gets several tasks.
TASKS_PER_SLOT = 4


def _batching(weight: Callable[[Any], int], total: int, in_flight: int) -> Batching | None:
    """How a pass of `total` input bytes, `in_flight` CPU tasks at a time (none where the
    GPU workers hold every CPU), batches its items."""
    least = min(TASK_BYTES, total // (TASKS_PER_SLOT * max(1, in_flight)))
    return Batching(weight, least) if least > 0 else None


def _cpu_work(job: Job, choice: DeviceChoice) -> tuple[int, dict[str, Any]]:
    """CPU tasks in flight, and the Ray options of each. With `--workers`, exactly that many
    run at once; by default twice the CPU slots (`DeviceChoice.cpu_slots`) are submitted,
    Ray runs as many as it has CPUs for, and the rest are queued so that a worker never
    waits on the driver. GPU work goes to the GPU workers (`engine.gpu`)."""
    in_flight = job.config.workers or 2 * choice.cpu_slots
    return in_flight, {"num_cpus": 1, "max_retries": SYSTEM_RETRIES}


@contextlib.contextmanager
def _devices(context: PassContext) -> Iterator[Devices]:
    """The devices a pass runs on: the context's (the job's, for all its passes), else this
    pass's own, for the context's cluster."""
    if context.devices is not None:
        yield context.devices
        return
    cluster = context.cluster
    with job_devices(context.job.device_choice(cluster.gpus, cluster.cpus)) as devices:
        yield devices


def _finish(stats: PassStats, devices: Devices) -> None:
    """A pass's wall time, and its GPU workers' busy share."""
    if devices.gpu is not None:
        stats.gpu_busy_share = devices.gpu.busy_share(stats.wall_s)


def _placement(
    storage: Storage, cache: InputCache | None, first_node: dict[int, str], kept: bool = False
) -> tuple[Storage, Callable[[WorkUnit], str | None]]:
    """The storage a pass's workers read through (with the cache, if any), and the node
    each unit should run on: the one that read it first, when a cache may hold its bytes or
    the node may keep its LoRA task values (`kept`, `engine.kept_values`)."""
    sent_back = (lambda unit: first_node.get(unit.index)) if cache or kept else lambda unit: None
    return (replace(storage, cache=cache) if cache else storage), sent_back


def reduce_pass(context: PassContext) -> tuple[dict[str, Any], PassStats]:
    """Every reduce round of the method: sum each unit's int64 statistics per key, then let
    the method fold the sums into its state. Rounds no tensor needs read nothing. The first
    round also counts NaN and Inf in every input (a check-only round for methods without
    statistics), unless the job allows them. With the context's input cache, what a round
    fetches is kept on its node, and `stats.first_node` says which node first read each
    unit. A work item is the units of one output part of at least the context's
    `min_part_bytes` (`PartPlan.unit_groups`); small items share a task (`_batching`)."""
    with _devices(context) as on:
        try:
            return _reduce_pass(context, on)
        except BaseException:
            _forget(context.kept)  # no map pass will read them
            raise


def _reduce_pass(context: PassContext, devices: Devices) -> tuple[dict[str, Any], PassStats]:
    job, progress = context.job, context.progress
    stats = PassStats()
    shipped = context.shipped or Shipped.of(job)
    groups = context.part_plan().unit_groups()
    storage, node_of = _placement(
        job.storage, context.cache, stats.first_node, context.kept is not None
    )
    start = time.perf_counter()
    stats.timeline.begin()
    method, state = job.method, job.initial_state()
    workers, resources = _cpu_work(job, devices.choice)
    numel = job.numel()
    check = not job.config.allow_nonfinite
    for round_ in range(job.reduce_rounds):
        checking = check and round_ == 0
        active = {
            n for n in job.params if round_ < method.rounds and method.active(round_, state, n)
        }
        wanted = set(job.params) if checking else active
        items = [
            kept
            for group in groups
            if (kept := tuple(u for u in group if any(p.tensor in wanted for p in u.pieces)))
        ]
        units = [u for group in items for u in group]
        if not units:
            continue
        stats.backward = stats.rounds_read % 2 == 0  # the first backwards (`PassStats.backward`)
        if stats.backward:
            items.reverse()
        stats.rounds_read += 1
        totals: dict[str, np.ndarray] = {}
        nonfinite: dict[str, list[int]] = {}
        checked = PrecisionCounts.zeros(len(job.tasks)) if checking else None
        flags = replace(work_flags(job, writes=False), kept=context.kept)
        shared = (shipped.context(storage, method, state, flags), round_, checking)
        total_bytes = sum(job.unit_bytes(u, wanted) for u in units)

        def group_bytes(group: tuple[WorkUnit, ...], wanted: set[str] = wanted) -> int:
            return sum(job.unit_bytes(u, wanted) for u in group)

        batching = _batching(group_bytes, total_bytes, workers)
        routing = Routing(lambda g: near(node_of(g[0])), devices.gpu, devices.on_gpu, batching)
        results = unordered_map(reduce_group, items, shared, workers, resources, routing)
        progress = progress or Progress()
        progress.start_pass(f"reduce {round_ + 1}", total_bytes, len(units))
        for group, node, result in results:
            stats.ran([u.index for u in group], node, result.traffic, node_of(group[0]))
            progress.advance(sum(result.bytes_read))
            add_up(result, totals, nonfinite, checked)
            stats.add(result, units=len(group), node=node)
        progress.end_pass()
        if nonfinite:
            raise _nonfinite_error(job, nonfinite)
        if checked is not None:
            if checked.overflow:
                raise _overflow_error(job, checked.overflow)
            stats.precision = checked
        if round_ < method.rounds:
            import torch  # loading since the checks (`preload`): waits for it at most

            sums = {key: torch.from_numpy(value) for key, value in totals.items()}
            state = method.finalize(RoundTotals(round_, sums, job.params, numel, state))
    stats.wall_s = time.perf_counter() - start
    stats.timeline.end()
    _finish(stats, devices)
    return state, stats


def work_flags(job: Job, *, writes: bool = True) -> WorkFlags:
    """The engine's settings for the fused kernels, shipped beside the method's state:
    whether they are on (`--kernels`), and, for a pass that `writes` merged values, the bits
    torch gives a NaN cast to bfloat16 on this machine (probed here, so that workers need
    not import torch; `preload` probes it beside the checks). A reduce pass writes none: its
    first tasks are sent without waiting for torch."""
    if not (job.config.kernels == "auto" and kernels.available()):
        return WorkFlags()
    return WorkFlags(fused=True, bf16_nan=preload.bf16_nan() if writes else None)


def _overflow_error(job: Job, found: dict[str, list[int]]) -> RamDistError:
    """Base values that have no value at a task's precision (`kernels.precision`): a finite
    base value beyond the largest float16 (or bfloat16) of a task stored in that dtype."""
    lines = []
    for name, counts in sorted(found.items()):
        entry = job.layout.tensors[name]
        for task, count, src in zip(job.tasks, counts, entry.sources[1:], strict=True):
            if count:
                lines.append(
                    f"tensor {name!r}: {count} finite base value(s) overflow "
                    f"{dtype_name(src.values_dtype)}, the precision of {task.describe(name)}"
                )
    shown = "; ".join(lines[:10]) + (f"; and {len(lines) - 10} more" if len(lines) > 10 else "")
    return RamDistError(
        f"a task's update cannot be measured against the base at its precision: {shown}. "
        "Such a base value has no value in the task's dtype (a trainer that loaded the base "
        "in it saw inf there); save the task in float32 or in the base's dtype"
    )


#: What a NaN or Inf decoded from a quantized input means (an FP8 NaN code; an MXFP4 scale
#: byte of 255, e8m0's NaN, or a value beyond float32: `kernels.fp8`, `kernels.mxfp4`).
DECODED_NONFINITE = " (decoded: a NaN code or scale in its stored form, or a value beyond float32)"


def _nonfinite_error(job: Job, found: dict[str, list[int]]) -> RamDistError:
    lines = []
    inputs = [job.base, *job.tasks]
    for name, counts in sorted(found.items()):
        sources = job.layout.tensors[name].sources
        for ckpt, count, src in zip(inputs, counts, sources, strict=False):
            if count:
                why = DECODED_NONFINITE if src.decoded else ""
                lines.append(f"tensor {name!r}: {count} NaN/Inf{why} in {ckpt.describe(name)}")
    shown = "; ".join(lines[:10]) + (f"; and {len(lines) - 10} more" if len(lines) > 10 else "")
    return RamDistError(
        f"non-finite values in the inputs: {shown}. Fix the checkpoint, or pass "
        "--allow-nonfinite to merge them as the rule computes them"
    )


def map_pass(context: PassContext, state: dict[str, Any], output: MapOutput) -> PassStats:
    """Merge the `output`'s shards part by part, results taken as they finish: each task
    writes its part through the sink's target (or sends it back, through the driver), and
    each shard is completed once all its parts are in, then recorded in the book. A resumed
    shard's parts already in place are not made again. With the context's input cache, the
    last reader of it, a part runs on its first unit's first node (while that node lives)
    and removes what it reads from the cache there; with `pin_to`, every part runs on that
    node (`MapOutput`). With `output.also` (a sweep's other variants), each part is made
    once for every output, from one read, and each output's shard completes on its own; a
    resumed sweep's part is made while any output lacks it, and written only to those (a
    shard an output finished, a part it holds: `KeptTarget`)."""
    try:
        with _devices(context) as on:
            return _map_pass(context, on, state, output)
    finally:
        _forget(context.kept)


def _forget(kept: KeptValues | None) -> None:
    """Delete a job's kept LoRA task values on every node (the map pass took and deleted
    those it read; this is what is left: another node's, or a failed job's)."""
    if kept is not None:
        on_every_node(kept.remove)


def _map_pass(
    context: PassContext, devices: Devices, state: dict[str, Any], output: MapOutput
) -> PassStats:
    job, progress, cache = context.job, context.progress, context.cache
    shards, sink, book, backward = output.shards, output.sink, output.book, output.backward
    pin_to = output.pin_to
    assert job.out is not None
    shipped = context.shipped or Shipped.of(job)
    stats = PassStats(output_path=sink.path, output_path_reason=sink.reason, backward=backward)
    last = cache.for_last_pass() if cache is not None else None
    storage, node_of = _placement(job.storage, last, output.first_node, context.kept is not None)
    start = time.perf_counter()
    stats.timeline.begin()
    workers, resources = _cpu_work(job, devices.choice)
    kept = context.kept.for_last_pass() if context.kept is not None else None
    flags = replace(work_flags(job), kept=kept)
    shared = (shipped.context(storage, job.method, state, flags),)
    units, headers, plan = context.part_plan(sink.min_part_bytes).of_shards(shards)
    outs = [(sink, book), *output.also]  # a sweep's variants: every part made once for all
    for name in shards:  # a shard a killed run was writing keeps the parts it recorded
        records = [(b.manifest.writing.get(name) or {}).get("plan") for _, b in outs]
        recorded = next((r for r in records if r), None)
        if recorded and recorded != plan_record(plan[name]):
            fresh = 1 + max([u.index for u in job.units] + list(units))
            again = parts_as_recorded(
                name, [units[i] for p in plan[name] for i in p.units],
                {n: itemsize(job.layout.tensors[n].out_dtype) for n in job.layout.shards[name]},
                len(headers[name]), recorded, fresh, job.layout.atomic_rows(name),
            )  # fmt: skip
            if again is not None:
                plan[name], cut = again
                units.update({u.index: u for u in cut})
    opened: list[dict[str, OpenShard]] = [{} for _ in outs]
    progress = progress or Progress()

    def read_bytes(part: Part) -> int:
        return sum(job.unit_bytes(units[i]) for i in part.units)

    map_bytes = sum(read_bytes(p) for ps in plan.values() for p in ps)
    progress.start_pass("map", map_bytes, len(units))

    def complete(k: int, shard: OpenShard) -> None:
        sink_k, book_k = outs[k]
        sink_k.complete(shard)
        digest = book_k.finished(shard)
        del opened[k][shard.name]
        stats.bytes_written += shard.size
        progress.event("shard_written", shard=shard.name, bytes=shard.size, digest=digest)

    def parts_to_make() -> Iterator[PartWork]:
        for name in reversed(shards) if backward else shards:
            size = plan[name][-1].stop
            open_k: list[OpenShard | None] = []  # None: finished already in that output
            for k, (sink_k, book_k) in enumerate(outs):
                if name in book_k.manifest.shards:  # a resumed sweep's variant finished it
                    open_k.append(None)
                    continue
                opened[k][name] = sink_k.open(
                    name, size, plan[name], book_k.manifest.writing.get(name)
                )
                book_k.opened(opened[k][name], plan[name])
                open_k.append(opened[k][name])
            for part in reversed(plan[name]) if backward else plan[name]:
                targets = [
                    s.target if s is not None and part.number not in s.done else None
                    for s in open_k
                ]
                if all(t is None for t in targets):  # in place in every output
                    progress.advance(read_bytes(part))
                    stats.parts_reused += 1
                    continue
                kept = KeptTarget(join(job.out, name))
                made = [kept if t is None else t for t in targets]
                part_units = tuple(units[i] for i in part.units)
                header = headers[name] if part.number == 1 else b""
                yield PartWork(part, part_units, header, made[0], tuple(made[1:]))
            for k, s in enumerate(open_k):
                if s is not None and len(s.done) == len(plan[name]) and name in opened[k]:
                    complete(k, s)  # every part was in already (a resumed shard)

    def placement(work: PartWork) -> Place | None:
        if pin_to is not None:
            return near(pin_to, only=True)
        return near(node_of(units[work.part.units[0]])) if work.part.units else None

    try:
        batching = _batching(lambda work: read_bytes(work.part), map_bytes, workers)
        routing = Routing(placement, devices.gpu, lambda work: devices.on_gpu(work.units), batching)
        for work, node, result in unordered_map(
            map_part, parts_to_make(), shared, workers, resources, routing
        ):
            if work.part.units:
                first = node_of(units[work.part.units[0]])
                stats.ran(work.part.units, node, result.traffic, first)
            progress.advance(sum(result.bytes_read))
            stats.add(result, units=len(work.part.units), node=node)
            stats.parts += 1
            assert result.receipt is not None
            for k, receipt in enumerate((result.receipt, *result.receipts)):
                sink_k, book_k = outs[k]
                shard = opened[k].get(receipt.shard)
                if shard is None or receipt.number in shard.done:
                    continue  # in place from a killed run (`KeptTarget`): not written again
                sink_k.accept(shard, receipt)
                if receipt.data is None:
                    stats.bytes_written_by_workers += receipt.stop - receipt.start
                shard.done[receipt.number] = replace(receipt, data=None)
                book_k.part_done(shard.done[receipt.number])
                if len(shard.done) == len(plan[shard.name]):
                    complete(k, shard)
            stats.driver_memory.note()  # the driver, holding this result
    except BaseException:
        for k, (sink_k, book_k) in enumerate(outs):
            for shard in list(opened[k].values()):
                sink_k.abort(shard)
                book_k.dropped(shard.name)
        raise
    stats.bytes_written_by_driver = sum(s.bytes_written_by_driver for s, _ in outs)
    progress.end_pass(bytes_written=stats.bytes_written)
    stats.wall_s = time.perf_counter() - start
    stats.timeline.end()
    _finish(stats, devices)
    return stats
