"""A sweep on the driver: many merges for the reads of one (`docs/sweeps.md`).

One lease holds the sweep's folder. One reduce pass gathers every variant's statistics
(`methods.sweep.Variants`: variants whose statistics coincide share them), and one map pass
reads each unit once and writes every variant's part through that variant's own sink
(`MapOutput.also`). Each variant's folder is then completed as its single merge's would be
(`driver.publish`): the same shards, index, manifest, report, card and config files. The
sweep's own report, `sweep_report.json`, lists the variants and what each pass read.

A sweep starts fresh: a variant folder that holds files is refused unless `--overwrite`
(resuming a killed sweep is not supported yet).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from ram_dist.engine import collector
from ram_dist.engine.driver import (
    CardWriter,
    connected_cluster,
    job_report,
    output_sink,
    pass_reports,
    precision_of,
    publish,
    warn,
)
from ram_dist.engine.gpu import Devices, job_devices
from ram_dist.engine.pass_context import MapOutput, PassContext, Shipped
from ram_dist.engine.passes import map_pass, reduce_pass
from ram_dist.engine.pool import on_every_node
from ram_dist.engine.progress import Progress
from ram_dist.engine.runtime import Cluster
from ram_dist.engine.shard_book import ShardBook
from ram_dist.errors import RamDistError
from ram_dist.io.lease import OutputLease
from ram_dist.io.manifest import Manifest, save_manifest
from ram_dist.io.names import SWEEP_REPORT_NAME
from ram_dist.io.non_weight_files import copy_files, non_weight_files
from ram_dist.io.storage import join
from ram_dist.io.writer import write_json
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.input_cache import cache_report, choose_input_cache
from ram_dist.planning.job import Job
from ram_dist.planning.output_state import check_not_an_input, check_writable, clear_published
from ram_dist.planning.plan_report import plan_report
from ram_dist.planning.sweep import Sweep, describe, prepare_sweep
from ram_dist.planning.written_config import quantization_left

__all__ = ["SweepClaim", "sweep_checks", "sweep_on", "sweep_plan"]


@dataclass(frozen=True)
class SweepClaim:
    """What `sweep_checks` gives: the planned sweep, under this run's lease on its folder."""

    sweep: Sweep
    lease: OutputLease


def sweep_checks(config: MergeConfig, held: contextlib.ExitStack) -> SweepClaim:
    """Everything a sweep does before it needs Ray: every variant checked and planned as its
    single merge (a method that cannot take the tasks, a grid name no method takes: refused
    here), each variant's folder fresh (or `--overwrite`), then the lease on the sweep's
    folder (entered into `held`)."""
    with collector.paused():
        sweep = prepare_sweep(config)
    for job in sweep.jobs:
        job.check_packed_shapes()
        check_not_an_input(job)
        _check_fresh(job)
    out = sweep.job.out
    assert out is not None
    check_writable(sweep.job)
    lease = OutputLease(out, sweep.job.storage, f"ram-dist sweep {uuid.uuid4().hex[:12]}")
    if sweep.job.storage.is_local(out) and not os.path.exists(out):
        held.callback(_remove_if_empty, out)  # the lease makes the folder
    held.enter_context(lease)
    return SweepClaim(sweep, lease)


def _check_fresh(job: Job) -> None:
    """A variant's folder must be absent or empty, unless the sweep may overwrite it."""
    assert job.out is not None
    fs, path = job.storage.fs(job.out)
    if job.config.overwrite or not fs.exists(path):
        return
    if fs.isdir(path) and not fs.ls(path, detail=False):
        return
    raise RamDistError(
        f"output {job.out} already holds files; a sweep writes fresh folders (a killed sweep "
        "is not resumed): choose another output location or pass --overwrite"
    )


def _remove_if_empty(folder: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def sweep_on(claim: SweepClaim, cluster: Cluster, card: CardWriter) -> dict[str, Any]:
    """Run the sweep once Ray is up and `sweep_checks` has passed (`api.run_merge`); returns
    the sweep's report, also written as `sweep_report.json`."""
    with collector.frozen():
        job = claim.sweep.job
        with job_devices(job.device_choice(cluster.gpus, cluster.cpus)) as devices:
            return _sweep_held(claim, cluster, devices, card)


def _sweep_held(
    claim: SweepClaim, cluster: Cluster, devices: Devices, card: CardWriter
) -> dict[str, Any]:
    sweep, lease = claim.sweep, claim.lease
    job = sweep.job.replanned(devices.choice.slots, cluster.memory)
    assert job.out is not None

    def still_ours() -> None:
        if lease.lost:
            raise RamDistError(f"output {job.out}: {lease.lost}; stopped before publishing more")

    progress = Progress(job.config.log_format)
    if lease.note:
        progress.event("lease_taken_over", output=job.out, note=lease.note)
    progress.event(
        "job_start", command="merge", method="sweep", output=job.out, units=len(job.units),
        variants=len(sweep.jobs), resumed=False,
    )  # fmt: skip
    cache, cache_note = choose_input_cache(job)
    outs = [output_sink(v) for v in sweep.jobs]
    context = PassContext(
        job, cluster, devices=devices, shipped=Shipped.of(job), progress=progress, cache=cache,
        min_part_bytes=outs[0][0].min_part_bytes,
    )  # fmt: skip
    state, reduce_stats = reduce_pass(context)
    precision = precision_of(job, reduce_stats)
    names = non_weight_files(job.base.url, job.storage)
    manifests = []
    for v, v_state in zip(sweep.jobs, state["variants"], strict=True):
        manifests.append(_start_output(v, v_state, precision, names))
    books = [
        ShardBook(m, _saver(v, m), still_ours) for v, m in zip(sweep.jobs, manifests, strict=True)
    ]
    output = MapOutput(
        list(job.layout.shards), outs[0][0], books[0], first_node=reduce_stats.first_node,
        pin_to=outs[0][1], backward=not reduce_stats.backward,
        also=tuple((o[0], b) for o, b in zip(outs[1:], books[1:], strict=True)),
    )  # fmt: skip
    map_stats = map_pass(context, state, output)
    passes = pass_reports({"reduce": reduce_stats, "map": map_stats})
    cleaned = len(on_every_node(cache.remove)) if cache is not None else 0
    out_dir = job.out
    variants = describe(sweep)
    for k, (v, manifest) in enumerate(zip(sweep.jobs, manifests, strict=True)):
        measured = [reduce_stats, map_stats]
        report = job_report(v, state["variants"][k], passes, measured, devices, precision)
        report["unit_budget_bytes"] = job.unit_budget_bytes  # the sweep's, as it ran
        report["input_cache"] = cache_report(job, cache, cache_note)
        report["input_cache"]["nodes_cleaned"] = cleaned
        report["output"] = {
            "url": v.out,
            "lease": {"url": lease.url, "took_over": lease.note},
            "files_copied": names,
            "shards_reused": [],
            "shards_written": list(v.layout.shards),
        }
        report["sweep"] = {"out": out_dir, "variant": variants[k]["name"]}
        if k == 0:
            warn(progress, report)
        publish(v, manifest, report, card, still_ours)
    report = {
        "method": "sweep",
        "variants": variants,
        "passes": {
            name: {"bytes_read": p["bytes_read"], "wall_s": p["wall_s"]}
            for name, p in passes.items()
        },
        "output": {"url": out_dir, "lease": {"url": lease.url, "took_over": lease.note}},
        "unit_budget_bytes": job.unit_budget_bytes,
    }
    still_ours()
    write_json(join(out_dir, SWEEP_REPORT_NAME), report, job.storage)
    progress.event(
        "done", output=out_dir, method="sweep", variants=len(variants),
        bytes_written=passes["map"]["bytes_written"],
    )  # fmt: skip
    return report


def _start_output(
    job: Job, state: dict[str, Any], precision: dict[str, Any] | None, names: list[str]
) -> Manifest:
    """A variant's folder before its map pass: cleared when overwriting, its manifest with
    its reduce state, and the base's config and tokenizer files."""
    assert job.out is not None
    fs, path = job.storage.fs(job.out)
    if job.config.overwrite and fs.exists(path):
        clear_published(job)
    fs.makedirs(path, exist_ok=True)
    manifest = Manifest(
        identity=job.identity(), shard_names=list(job.layout.shards), sharded=job.layout.sharded
    )
    manifest.method_state = state
    manifest.precision = precision
    save_manifest(job.out, manifest, job.storage)
    copy_files(
        job.base.url, job.out, names, job.storage,
        job.layout.config_dtype(job.config.out_dtype), quantization_left(job),
    )  # fmt: skip
    return manifest


def _saver(job: Job, manifest: Manifest) -> Any:
    assert job.out is not None
    out = job.out
    return lambda: save_manifest(out, manifest, job.storage)


def sweep_plan(config: MergeConfig) -> dict[str, Any]:
    """`plan` of a sweep: the sweep's job's plan (what each pass reads, once for every
    variant), with the variants listed."""
    with collector.paused():
        sweep = prepare_sweep(config)
        report = plan_report(sweep.job, connected_cluster())
    report["method"] = "sweep"
    report["parameters"] = "each variant's, below"
    report["sweep"] = {"variants": describe(sweep)}
    return report
