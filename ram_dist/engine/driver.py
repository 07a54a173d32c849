"""The merge job on the driver: check, plan, reduce pass, lambda, map pass, publish.

Nothing heavy happens before every input has been checked. Workers write the shards' parts
themselves where the store allows it (an S3 multipart upload, a filesystem every worker
sees), else the driver streams them; shards appear under their final names only when
complete, each recorded with its parts' digests in the manifest; the index is written last,
so a reader never takes a partial result for a model. Re-running the same job on the same
output resumes: the reduce statistics, the finished shards and the finished parts of an
unfinished shard are reused.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import ray

from ram_dist import __version__
from ram_dist.engine import collector, memory, preload
from ram_dist.engine.gpu import Devices, job_devices
from ram_dist.engine.kept_values import kept_for
from ram_dist.engine.pass_context import MapOutput, PassContext, Shipped
from ram_dist.engine.pass_stats import PassStats
from ram_dist.engine.passes import map_pass, reduce_pass
from ram_dist.engine.pool import alive_nodes, on_every_node, this_node
from ram_dist.engine.progress import Progress
from ram_dist.engine.runtime import Cluster
from ram_dist.engine.shard_book import ShardBook
from ram_dist.errors import RamDistError
from ram_dist.io.json_files import MAX_REPORT_BYTES, read_json
from ram_dist.io.lease import OutputLease
from ram_dist.io.manifest import Manifest, save_manifest
from ram_dist.io.names import CARD_NAME, MERGEKIT_CONFIG_NAME, REPORT_NAME
from ram_dist.io.non_weight_files import copy_files, non_weight_files
from ram_dist.io.sinks import FileSink, OutputSink
from ram_dist.io.storage import join
from ram_dist.io.writer import AtomicFile, write_index, write_json
from ram_dist.methods import get_method
from ram_dist.methods.agreement import ProbeStatistics
from ram_dist.planning import job as planning
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.input_cache import cache_report, choose_input_cache
from ram_dist.planning.job import Job
from ram_dist.planning.output_state import (
    OutputState,
    check_writable,
    clear_published,
    open_output,
    output_sink_for,
)
from ram_dist.planning.plan_report import ConnectedCluster, plan_report
from ram_dist.planning.precision import checked_tensors
from ram_dist.planning.written_config import quantization_left, render
from ram_dist.report.rounding import precision_report

#: What `probe` counts with when the configured method counts no overlap statistics.
PROBE_METHOD = "ram_plus"

#: What `ram_dist.api` runs: the one entry point, `api.run_merge`/`run_probe`/`run_plan`.
__all__ = [
    "REPORT_NAME", "merge_checks", "merge_on", "plan", "prepare", "probe_checks", "probe_on",
]  # fmt: skip


def prepare(config: MergeConfig) -> Job:
    """`planning.job.prepare`, with Python's cyclic garbage collector paused
    (`collector.paused`): planning allocates a few objects per tensor and input, millions for
    a large MoE checkpoint, and frees almost none until it ends, none of them in reference
    cycles, so every collection the allocations trigger scans all that survived so far for
    nothing (DeepSeek-V3, base and three tasks: 5.6 s of CPU with the collector, 2.6 s
    without, to read the headers). Cycles made meanwhile are collected once it is back on.

    torch, which the passes need on the driver (a reduce round's sums, the fused kernels'
    NaN probe), starts loading here, in a thread of its own (`preload`): beside the checks
    and Ray's start, and never between Ray's start and the first task (about a second)."""
    preload.start()
    with collector.paused():
        return planning.prepare(config)


def probe_checks(config: MergeConfig) -> Job:
    """Everything a probe does before it needs Ray: the checks and the plan."""
    if not get_method(config.method).reports_overlap:
        counting = {p.name for p in get_method(PROBE_METHOD).parameters if not p.per_task}
        config = replace(
            config,
            method=PROBE_METHOD,
            parameters={k: v for k, v in config.parameters.items() if k in counting},
            task_parameters=(),
        )
    job = prepare(config)
    job.check_packed_shapes()
    # The reduce pass also counts the tasks' sign agreement and update sizes
    # (`methods.agreement`): a probe's own statistics, never a merge's.
    job = replace(job, composite=ProbeStatistics(job.method))
    Progress(config.log_format).event(
        "job_start", command="probe", method="ram statistics", units=len(job.units)
    )
    return job


def probe_on(job: Job, cluster: Cluster) -> dict[str, Any]:
    """RAM's reduce pass only (whatever the method): the statistics report, once Ray is up
    and `probe_checks` has passed (`api.run_probe`)."""
    device = job.device_choice(cluster.gpus, cluster.cpus)
    job = job.replanned(device.slots, cluster.memory)
    with collector.frozen(), job_devices(device) as devices:
        progress = Progress(job.config.log_format)
        context = PassContext(job, cluster, devices=devices, progress=progress)
        method_state, stats = reduce_pass(context)
        passes = pass_reports({"reduce": stats})
        report = job_report(job, method_state, passes, [stats], devices, precision_of(job, stats))
        warn(progress, report)
        return report


Claim = dict[str, Any] | tuple[Job, OutputState, OutputLease]
"""What `merge_checks` gives: the stored report of a finished output, or what to merge."""


class CardWriter(Protocol):
    """The model card's text from the report (`report.model_card.model_card` is one): the
    entry point gives it, so that the engine knows nothing of presentation. The driver
    writes the card, under the output's lease, before it marks the manifest complete."""

    def __call__(
        self,
        report: Mapping[str, Any],
        *,
        base: str,
        inputs: Sequence[Mapping[str, Any]],
        version: str,
    ) -> str: ...


def merge_on(claim: Claim, cluster: Cluster, card: CardWriter) -> dict[str, Any]:
    """Run (or resume) the whole merge, once Ray is up and `merge_checks` has passed
    (`api.run_merge`); returns the report also written as merge_report.json."""
    if isinstance(claim, dict):
        return claim
    # The job's headers, layout, parameters and units, a million objects for a checkpoint of
    # 100k tensors, left alone by the collector during the passes (each full collection
    # would scan them again: seconds each), still freed as usual afterwards.
    with collector.frozen():
        job = claim[0]
        with job_devices(job.device_choice(cluster.gpus, cluster.cpus)) as devices:
            return _merge_held(*claim, cluster, devices, card)


def merge_checks(config: MergeConfig, held: contextlib.ExitStack) -> Claim:
    """Everything a merge does before it needs Ray: every up-front check, then this run's
    lease on the output (entered into `held`); or the stored report when the output already
    holds this merge."""
    if config.out is None:
        raise RamDistError("merge needs an output location: --out PATH")
    job = prepare(config)
    assert job.out is not None
    job.check_packed_shapes()
    # One writer per output: claim it before writing anything, then look again under the
    # claim (a run that held it a moment ago may have written meanwhile).
    lease = OutputLease(job.out, job.storage, f"ram-dist merge {uuid.uuid4().hex[:12]}")
    with lease.naming_a_live_holder():
        found = open_output(job)
    check_writable(job)
    if found.finished:
        return _finished_report(job)
    if job.storage.is_local(job.out) and not os.path.exists(job.out):
        # The lease makes the folder: leave none behind when nothing was written.
        held.callback(_remove_if_empty, job.out)
    held.enter_context(lease)
    found = open_output(job)
    if found.finished:
        return _finished_report(job)
    return job, found, lease


def _remove_if_empty(folder: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _merge_held(
    job: Job,
    found: OutputState,
    lease: OutputLease,
    cluster: Cluster,
    devices: Devices,
    card: CardWriter,
) -> dict[str, Any]:
    """The merge, once this run holds the output's lease, on the job's `devices`."""
    config = job.config
    assert job.out is not None
    device = devices.choice

    def still_ours() -> None:
        if lease.lost:
            raise RamDistError(f"output {job.out}: {lease.lost}; stopped before publishing more")

    manifest = found.manifest
    fs, path = job.storage.fs(job.out)
    if config.overwrite:
        clear_published(job)
    progress = Progress(config.log_format)
    if lease.note:
        progress.event("lease_taken_over", output=job.out, note=lease.note)
    progress.event(
        "job_start", command="merge", method=job.method.name, output=job.out,
        units=len(job.units), resumed=found.resumed,
    )  # fmt: skip
    cache, cache_note = choose_input_cache(job)
    first_node: dict[int, str] = {}
    job = job.replanned(device.slots, cluster.memory)
    sink, pin_to = output_sink(job)
    passes: dict[str, Any] = {}
    measured: list[PassStats] = []
    context = PassContext(  # both passes': the values shipped once, the parts planned once
        job, cluster, devices=devices, shipped=Shipped.of(job), progress=progress, cache=cache,
        min_part_bytes=sink.min_part_bytes, kept=kept_for(job),
    )  # fmt: skip
    if manifest.method_state is not None:
        method_state = manifest.method_state
        passes["reduce"] = {"skipped": True, "units": 0, "bytes_read": 0, "wall_s": 0.0}
    else:
        method_state, reduce_stats = reduce_pass(context)
        first_node = reduce_stats.first_node
        measured.append(reduce_stats)
        fs.makedirs(path, exist_ok=True)
        manifest.method_state = method_state
        manifest.precision = precision_of(job, reduce_stats)
        save_manifest(job.out, manifest, job.storage)
    names = non_weight_files(job.base.url, job.storage)
    copy_files(
        job.base.url, job.out, names, job.storage, job.layout.config_dtype(config.out_dtype),
        quantization_left(job),
    )  # fmt: skip

    done = kept_shards(job, manifest)
    todo = [s for s in manifest.shard_names if s not in done]
    book = ShardBook(manifest, lambda: save_manifest(job.out, manifest, job.storage), still_ours)
    backward = bool(measured) and not measured[0].backward  # against the last reduce round
    output = MapOutput(todo, sink, book, first_node=first_node, pin_to=pin_to, backward=backward)
    map_stats = map_pass(context, method_state, output)
    measured.append(map_stats)
    ran = {"reduce": measured[0], "map": map_stats} if len(measured) == 2 else {"map": map_stats}
    passes.update(pass_reports(ran))
    cleaned = len(on_every_node(cache.remove)) if cache is not None else 0

    report = job_report(job, method_state, passes, measured, devices, manifest.precision)
    report["input_cache"] = cache_report(job, cache, cache_note)
    report["input_cache"]["nodes_cleaned"] = cleaned
    report["output"] = {
        "url": job.out,
        "lease": {"url": lease.url, "took_over": lease.note},
        "files_copied": names,
        "shards_reused": done,
        "shards_written": [s for s in manifest.shard_names if s not in done],
    }
    warn(progress, report)
    publish(job, manifest, report, card, still_ours)
    progress.event(
        "done", output=job.out, method=job.method.name,
        densities=[t.get("density") for t in report.get("tasks", [])],
        lambdas=report.get("lambda_applied"), bytes_written=passes["map"]["bytes_written"],
    )  # fmt: skip
    return report


def kept_shards(job: Job, manifest: Manifest) -> list[str]:
    """The shards a resumed output holds finished, in order; the manifest forgets a finished
    shard whose file is gone (it is made again) and the writing of those it holds."""
    assert job.out is not None
    fs, path = job.storage.fs(job.out)
    done = [s for s in manifest.shard_names if s in manifest.shards and fs.exists(join(path, s))]
    for shard in manifest.shard_names:
        if shard in done:
            manifest.writing.pop(shard, None)
        else:
            manifest.shards.pop(shard, None)
    return done


def publish(
    job: Job,
    manifest: Manifest,
    report: dict[str, Any],
    card: CardWriter,
    still_ours: Callable[[], None],
) -> None:
    """An output's last files, once its shards are in: the report, `mergekit_config.yml`,
    the model card, the manifest marked complete, and the index last (a reader never takes
    a partial result for a model); `still_ours` raises when the lease was lost."""
    assert job.out is not None
    config = job.config
    write_json(join(job.out, REPORT_NAME), report, job.storage)
    with AtomicFile(join(job.out, MERGEKIT_CONFIG_NAME), job.storage) as f:
        f.write(render(job).encode())
    text = card(report, base=config.base, inputs=job.identity()["inputs"], version=__version__)
    with AtomicFile(join(job.out, CARD_NAME), job.storage) as f:
        f.write(text.encode())
    still_ours()
    manifest.complete = True
    save_manifest(job.out, manifest, job.storage)
    if job.layout.sharded:
        weight_map = {t: shard for shard, names_ in job.layout.shards.items() for t in names_}
        total_size = sum(t.nbytes for s in job.layout.shards for t in job.layout.out_tensors(s))
        write_index(job.out, weight_map, total_size, job.storage)


def output_sink(job: Job) -> tuple[OutputSink, str | None]:
    """The sink the map pass writes through, and the node every part must run on when the
    output is a local folder only the driver's node sees (None: anywhere)."""
    sink = output_sink_for(job, alive_nodes())
    pin = isinstance(sink, FileSink) and not job.config.output_shared
    return sink, this_node() if pin else None


def plan(config: MergeConfig) -> dict[str, Any]:
    """Headers only: every up-front check, then what the job would read, run and write
    (`planning.plan_report`), on the Ray this process is connected to, if any.

    The garbage collector stays paused until the job is freed: the collection that turning it
    back on starts then finds the few objects of the report, not every tensor's.
    """
    with collector.paused():
        job = prepare(config)
        return plan_report(job, connected_cluster())


def connected_cluster() -> ConnectedCluster | None:
    """The size of the Ray this process is connected to; None when it is connected to none."""
    if not ray.is_initialized():
        return None
    res = ray.cluster_resources()
    return ConnectedCluster(
        gpus=int(res.get("GPU", 0)), cpus=int(res.get("CPU", 1)), memory=int(res.get("memory", 0))
    )


def _device_report(devices: Devices) -> dict[str, Any]:
    """The device choice, and the GPU worker processes the job had (restarts included)."""
    out = devices.choice.as_dict()
    out["gpu_worker_processes"] = len(devices.gpu.processes) if devices.gpu is not None else 0
    return out


def _finished_report(job: Job) -> dict[str, Any]:
    """The stored report of a merge that is already complete; nothing is recomputed."""
    assert job.out is not None
    try:
        report = read_json(
            join(job.out, REPORT_NAME), job.storage, MAX_REPORT_BYTES, "report", "output"
        )
    except FileNotFoundError:
        report = {}
    if not isinstance(report, dict):
        raise RamDistError(f"output {join(job.out, REPORT_NAME)}: not a ram-dist report")
    report["already_complete"] = True
    return report


def pass_reports(ran: dict[str, PassStats]) -> dict[str, dict[str, Any]]:
    """Each pass's report, in order, with the worker processes it started (that no earlier
    pass of the job had used)."""
    seen: set[str] = set()
    out = {}
    for name, stats in ran.items():
        out[name] = stats.as_dict()
        out[name]["worker_processes_started"] = len(stats.workers - seen)
        seen |= stats.workers
    return out


def warn(progress: Progress, report: Mapping[str, Any]) -> None:
    """The precision check's warnings as `warning` events (the text report prints them)."""
    for line in (report.get("precision") or {}).get("warnings", []):
        progress.event("warning", message=line)


def precision_of(job: Job, reduce: PassStats) -> dict[str, Any] | None:
    """The report's `precision` key from the reduce pass's check (None: it did not run, as
    with `--allow-nonfinite`)."""
    checked = reduce.precision
    if checked is None:
        return None
    models = [t.url for t in job.tasks]
    return precision_report(checked.changed, checked.rounding, models, checked_tensors(job.layout))


def job_report(
    job: Job,
    method_state: dict[str, Any],
    passes: dict[str, Any],
    measured: list[PassStats],
    devices: Devices,
    precision: dict[str, Any] | None,
) -> dict[str, Any]:
    config = job.config
    report: dict[str, Any] = {
        "ram_dist_version": __version__,
        "method": job.method.name,
        "parameters": job.effective_parameters(),
        "base": config.base,
        "tasks_given": list(config.tasks),
        "notes": list(config.notes),
        "out_dtype": config.out_dtype,
        "unit_budget_bytes": job.unit_budget_bytes,
        "device": _device_report(devices),
        "formats": job.formats(),
        "integers_from_base": {
            "allowed": config.integers_from_base,
            "copied_though_changed": list(job.integers_changed),
        },
        "extra_tensors": job.extra_tensors(),
    }
    report.update(job.method.report(method_state))
    if precision is not None:
        report["precision"] = precision
    for url, t in zip(config.tasks, report.get("tasks", []), strict=False):
        t["model"] = url
    report["passes"] = passes
    report["memory"] = {
        "driver_peak_rss_bytes": memory.peak_rss(),
        "worker_peak_rss_bytes": max((p.worker_peak_rss_bytes for p in measured), default=0),
        "driver_peak_private_bytes": max(  # this job's, not the process's: a notebook may
            [memory.PeakMemory().note(now=True)]  # run several
            + [p.driver_memory.peak for p in measured]
        ),
        "worker_peak_private_bytes": max(
            (p.worker_peak_private_bytes for p in measured), default=0
        ),
    }
    return report
