"""A sweep on the driver: many merges for the reads of one (`docs/sweeps.md`).

One lease holds the sweep's folder. One reduce pass gathers every variant's statistics
(`methods.sweep.Variants`: variants whose statistics coincide share them), and one map pass
reads each unit once and writes every variant's part through that variant's own sink
(`MapOutput.also`). Each variant's folder is then completed as its single merge's would be
(`driver.publish`): the same shards, index, manifest, report, card and config files. The
sweep's own report, `sweep_report.json`, lists the variants and what each pass read.

Rerun on the same folder, a killed sweep resumes as a single merge does: the sweep's record
(`ram_dist_sweep.json`, written before any variant's folder) must list the same variants, and
each variant's manifest the same inputs and parameters (else refused, naming what changed);
the reduce pass is skipped when every variant holds its statistics, each variant keeps the
shards and parts it finished (`passes.map_pass`: a part is made while any variant lacks it,
and written only to those), and a variant already complete is left as it is.
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
    kept_shards,
    output_sink,
    pass_reports,
    precision_of,
    publish,
    warn,
)
from ram_dist.engine.gpu import Devices, job_devices
from ram_dist.engine.pass_context import MapOutput, PassContext, Shipped
from ram_dist.engine.pass_stats import PassStats
from ram_dist.engine.passes import map_pass, reduce_pass
from ram_dist.engine.pool import on_every_node
from ram_dist.engine.progress import Progress
from ram_dist.engine.runtime import Cluster
from ram_dist.engine.shard_book import ShardBook
from ram_dist.errors import RamDistError
from ram_dist.io.json_files import MAX_REPORT_BYTES, read_json
from ram_dist.io.lease import OutputLease
from ram_dist.io.manifest import Manifest, save_manifest
from ram_dist.io.names import SWEEP_MANIFEST_NAME, SWEEP_REPORT_NAME
from ram_dist.io.non_weight_files import copy_files, non_weight_files
from ram_dist.io.storage import join
from ram_dist.io.writer import write_json
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.input_cache import cache_report, choose_input_cache
from ram_dist.planning.job import Job
from ram_dist.planning.output_state import (
    OutputState,
    check_not_an_input,
    check_writable,
    clear_published,
    open_output,
)
from ram_dist.planning.plan_report import plan_report
from ram_dist.planning.sweep import Sweep, describe, prepare_sweep
from ram_dist.planning.written_config import quantization_left

__all__ = ["SweepClaim", "sweep_checks", "sweep_on", "sweep_plan"]


@dataclass(frozen=True)
class SweepClaim:
    """What `sweep_checks` gives: the planned sweep, under this run's lease on its folder,
    with what each variant's folder holds (new, resumable or finished)."""

    sweep: Sweep
    lease: OutputLease
    found: list[OutputState]


def sweep_checks(config: MergeConfig, held: contextlib.ExitStack) -> SweepClaim | dict[str, Any]:
    """Everything a sweep does before it needs Ray: every variant checked and planned as its
    single merge (a method that cannot take the tasks, a grid name no method takes: refused
    here), the folder's sweep the same as this one (or `--overwrite`), then the lease on the
    sweep's folder (entered into `held`) and each variant's folder looked at again under it.
    A sweep found complete gives its stored report."""
    with collector.paused():
        sweep = prepare_sweep(config)
    sweep.job.check_packed_shapes()  # the inputs every variant shares: read once
    for job in sweep.jobs:
        check_not_an_input(job)
    out = sweep.job.out
    assert out is not None
    check_writable(sweep.job)
    lease = OutputLease(out, sweep.job.storage, f"ram-dist sweep {uuid.uuid4().hex[:12]}")
    with lease.naming_a_live_holder():
        _check_same_sweep(sweep)
        for v in sweep.jobs:  # a changed variant: refused before the lease
            open_output(v)
    if sweep.job.storage.is_local(out) and not os.path.exists(out):
        held.callback(_remove_if_empty, out)  # the lease makes the folder
    held.enter_context(lease)
    _check_same_sweep(sweep)
    found = [open_output(v) for v in sweep.jobs]
    if all(f.finished for f in found):
        stored = _stored_report(sweep)
        if stored is not None:
            return stored
    return SweepClaim(sweep, lease, found)


def _record(sweep: Sweep) -> dict[str, Any]:
    """What the sweep's record keeps: its variants' names and methods, in order."""
    return {"variants": [{"name": v.name, "method": v.method} for v in sweep.variants]}


def _check_same_sweep(sweep: Sweep) -> None:
    """A folder that holds a sweep's record holds this sweep (else refused, naming the
    variants that differ); one without holds no variant folder with files."""
    job = sweep.job
    assert job.out is not None
    if job.config.overwrite:
        return
    try:
        old = read_json(
            join(job.out, SWEEP_MANIFEST_NAME), job.storage, MAX_REPORT_BYTES, "sweep record",
            "output",
        )  # fmt: skip
    except FileNotFoundError:
        for v in sweep.jobs:
            assert v.out is not None
            fs, path = v.storage.fs(v.out)
            if fs.exists(path) and (not fs.isdir(path) or fs.ls(path, detail=False)):
                raise RamDistError(
                    f"output {v.out} already holds files and {job.out} no sweep record "
                    f"({SWEEP_MANIFEST_NAME}); choose another output location or pass "
                    "--overwrite"
                ) from None
        return
    was = [v.get("name") for v in old.get("variants", [])] if isinstance(old, dict) else []
    now = [v["name"] for v in _record(sweep)["variants"]]
    if was != now:
        gone = [n for n in was if n not in now]
        new = [n for n in now if n not in was]
        what = (
            "; ".join(
                [*(f"variant {n} removed" for n in gone), *(f"variant {n} added" for n in new)]
            )
            or f"variants reordered: {', '.join(map(str, was))} -> {', '.join(now)}"
        )
        raise RamDistError(
            f"output {job.out} holds a sweep of other variants; changed: {what}. Use another "
            "output location, or pass --overwrite to replace it"
        )


def _stored_report(sweep: Sweep) -> dict[str, Any] | None:
    """The stored report of a sweep found complete (None: it was not written yet)."""
    assert sweep.job.out is not None
    try:
        report = read_json(
            join(sweep.job.out, SWEEP_REPORT_NAME), sweep.job.storage, MAX_REPORT_BYTES,
            "sweep report", "output",
        )  # fmt: skip
    except FileNotFoundError:
        return None
    if not isinstance(report, dict):
        raise RamDistError(f"output {sweep.job.out}: {SWEEP_REPORT_NAME} is not a sweep's report")
    report["already_complete"] = True
    return report


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
    sweep, lease, found = claim.sweep, claim.lease, claim.found
    job = sweep.job.replanned(devices.choice.slots, cluster.memory)
    assert job.out is not None

    def still_ours() -> None:
        if lease.lost:
            raise RamDistError(f"output {job.out}: {lease.lost}; stopped before publishing more")

    progress = Progress(job.config.log_format)
    if lease.note:
        progress.event("lease_taken_over", output=job.out, note=lease.note)
    resumed = any(f.resumed for f in found)
    progress.event(
        "job_start", command="merge", method="sweep", output=job.out, units=len(job.units),
        variants=len(sweep.jobs), resumed=resumed,
    )  # fmt: skip
    write_json(join(job.out, SWEEP_MANIFEST_NAME), _record(sweep), job.storage)
    cache, cache_note = choose_input_cache(job)
    outs = [output_sink(v) for v in sweep.jobs]
    context = PassContext(
        job, cluster, devices=devices, shipped=Shipped.of(job), progress=progress, cache=cache,
        min_part_bytes=outs[0][0].min_part_bytes,
    )  # fmt: skip
    kept = [f.manifest.method_state for f in found]
    measured: list[PassStats] = []
    passes: dict[str, Any] = {}
    if all(s is not None for s in kept):  # every variant holds its statistics
        state: dict[str, Any] = {"variants": kept, "share": list(range(len(kept)))}
        precision = found[0].manifest.precision
        passes["reduce"] = {"skipped": True, "units": 0, "bytes_read": 0, "wall_s": 0.0}
    else:
        state, reduce_stats = reduce_pass(context)
        measured.append(reduce_stats)
        precision = precision_of(job, reduce_stats)
        # A variant that holds statistics made its parts from them: it keeps them.
        made = zip(kept, state["variants"], strict=True)
        state["variants"] = [old if old is not None else new for old, new in made]
    names = non_weight_files(job.base.url, job.storage)
    manifests = [
        _start_output(v, f, state["variants"][k], precision, names)
        for k, (v, f) in enumerate(zip(sweep.jobs, found, strict=True))
    ]
    reused = [kept_shards(v, m) for v, m in zip(sweep.jobs, manifests, strict=True)]
    books = [
        ShardBook(m, _saver(v, m), still_ours) for v, m in zip(sweep.jobs, manifests, strict=True)
    ]
    todo = [s for s in job.layout.shards if any(s not in done for done in reused)]
    output = MapOutput(
        todo, outs[0][0], books[0], first_node=measured[0].first_node if measured else {},
        pin_to=outs[0][1], backward=bool(measured) and not measured[0].backward,
        also=tuple((o[0], b) for o, b in zip(outs[1:], books[1:], strict=True)),
    )  # fmt: skip
    map_stats = map_pass(context, state, output)
    measured.append(map_stats)
    ran = dict(zip(["reduce", "map"][-len(measured) :], measured, strict=True))
    passes.update(pass_reports(ran))
    cleaned = len(on_every_node(cache.remove)) if cache is not None else 0
    out_dir = job.out
    variants = describe(sweep)
    for k, (v, manifest) in enumerate(zip(sweep.jobs, manifests, strict=True)):
        if found[k].finished:
            continue  # complete before this run: left as it is
        report = job_report(v, state["variants"][k], passes, measured, devices, precision)
        report["unit_budget_bytes"] = job.unit_budget_bytes  # the sweep's, as it ran
        report["input_cache"] = cache_report(job, cache, cache_note)
        report["input_cache"]["nodes_cleaned"] = cleaned
        report["output"] = {
            "url": v.out,
            "lease": {"url": lease.url, "took_over": lease.note},
            "files_copied": names,
            "shards_reused": reused[k],
            "shards_written": [s for s in v.layout.shards if s not in reused[k]],
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
        "output": {
            "url": out_dir,
            "lease": {"url": lease.url, "took_over": lease.note},
            "resumed": resumed,
            "shards_reused": {v["name"]: r for v, r in zip(variants, reused, strict=True)},
        },
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
    job: Job,
    found: OutputState,
    state: dict[str, Any],
    precision: dict[str, Any] | None,
    names: list[str],
) -> Manifest:
    """A variant's folder before its map pass: a resumed one's manifest as found (a complete
    one untouched); else cleared when overwriting, a manifest with its reduce state; then the
    base's config and tokenizer files."""
    assert job.out is not None
    manifest = found.manifest
    if found.finished:
        return manifest
    if not found.resumed:
        fs, path = job.storage.fs(job.out)
        if job.config.overwrite and fs.exists(path):
            clear_published(job)
        fs.makedirs(path, exist_ok=True)
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
