"""The merge job on the driver: check, plan, reduce pass, lambda, map pass, publish.

Nothing heavy happens before every input has been checked. The output folder is created
only when the map pass starts; shards appear under their final names only when complete,
and the index is written last, so a reader never takes a partial result for a model.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ram_dist import __version__
from ram_dist.config import MergeConfig
from ram_dist.engine.layout import Layout, build_layout
from ram_dist.engine.pool import ordered_map
from ram_dist.engine.runtime import Cluster, ray_cluster
from ram_dist.engine.work import map_unit, reduce_unit
from ram_dist.errors import RamDistError
from ram_dist.io.checkpoint import Checkpoint, open_checkpoint
from ram_dist.io.files import copy_files, non_weight_files
from ram_dist.io.locations import resolve_location, resolve_output
from ram_dist.io.storage import Storage, join
from ram_dist.io.writer import ShardWriter, write_index, write_json
from ram_dist.methods import get_method
from ram_dist.plan import WorkUnit, plan_units

REPORT_NAME = "merge_report.json"


@dataclass
class PassStats:
    """Counters of one pass, for the report."""

    units: int = 0
    wall_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    max_unit_bytes_read: list[int] = field(default_factory=list)
    worker_peak_rss_bytes: int = 0

    def add(self, bytes_read: tuple[int, ...], peak_rss: int) -> None:
        self.units += 1
        self.bytes_read += sum(bytes_read)
        if not self.max_unit_bytes_read:
            self.max_unit_bytes_read = [0] * len(bytes_read)
        self.max_unit_bytes_read = [
            max(a, b) for a, b in zip(self.max_unit_bytes_read, bytes_read, strict=True)
        ]
        self.worker_peak_rss_bytes = max(self.worker_peak_rss_bytes, peak_rss)

    def as_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "wall_s": round(self.wall_s, 4),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "max_unit_bytes_read_per_input": self.max_unit_bytes_read,
        }


@dataclass(frozen=True)
class Job:
    """Everything known once the inputs are checked, before any tensor byte is read."""

    config: MergeConfig
    storage: Storage
    base: Checkpoint
    tasks: list[Checkpoint]
    layout: Layout
    units: list[WorkUnit]
    out: str | None


def prepare(config: MergeConfig) -> Job:
    """Resolve locations, read every header, check that the inputs fit, plan the work."""
    storage = Storage(config.storage_options)
    base_url = resolve_location(config.base, "base model")
    base = open_checkpoint(base_url, "base model", storage)
    tasks = []
    for i, location in enumerate(config.tasks):
        label = f"task {i + 1}"
        tasks.append(open_checkpoint(resolve_location(location, label), label, storage))
    layout = build_layout(base, tasks, config.out_dtype)
    units = plan_units(layout.slots(), config.chunk_bytes)
    out = resolve_output(config.out) if config.out is not None else None
    return Job(config, storage, base, tasks, layout, units, out)


def probe(config: MergeConfig) -> dict[str, Any]:
    """Run the reduce pass only and return the statistics report."""
    job = prepare(config)
    with ray_cluster(config.address) as cluster:
        finalized, stats = _reduce_pass(job, cluster)
    return _report(job, finalized, {"reduce": stats.as_dict()}, stats.worker_peak_rss_bytes)


def merge(config: MergeConfig) -> dict[str, Any]:
    """Run the whole merge; returns the report that is also written as merge_report.json."""
    if config.out is None:
        raise RamDistError("merge needs an output location (--out)")
    job = prepare(config)
    assert job.out is not None
    _check_output(job)
    with ray_cluster(config.address) as cluster:
        finalized, reduce_stats = _reduce_pass(job, cluster)
        out_fs, out_path = job.storage.fs(job.out)
        created = not out_fs.exists(out_path)
        try:
            out_fs.makedirs(out_path, exist_ok=True)
            names = non_weight_files(job.base.url, job.storage)
            copy_files(job.base.url, job.out, names, job.storage)
            map_stats, weight_map, total_size = _map_pass(job, cluster, finalized)
            report = _report(
                job,
                finalized,
                {"reduce": reduce_stats.as_dict(), "map": map_stats.as_dict()},
                max(reduce_stats.worker_peak_rss_bytes, map_stats.worker_peak_rss_bytes),
            )
            report["output"] = {"url": job.out, "files_copied": names}
            write_json(join(job.out, REPORT_NAME), report, job.storage)
            if job.layout.sharded:
                write_index(job.out, weight_map, total_size, job.storage)
        except BaseException:
            if created and out_fs.exists(out_path):
                out_fs.rm(out_path, recursive=True)
            raise
    return report


def _check_output(job: Job) -> None:
    assert job.out is not None
    fs, path = job.storage.fs(job.out)
    if fs.exists(path):
        if not fs.isdir(path):
            raise RamDistError(f"output {job.out} exists and is not a folder")
        if fs.ls(path) and not job.config.overwrite:
            raise RamDistError(
                f"output {job.out} already holds files; choose an empty location or "
                "pass --overwrite"
            )


def _resources(cluster: Cluster) -> dict[str, float]:
    return {"num_cpus": 1, "num_gpus": 1} if cluster.gpus else {"num_cpus": 1}


def _workers(config: MergeConfig, cluster: Cluster) -> int:
    return config.workers or (cluster.gpus or cluster.cpus)


def _reduce_pass(job: Job, cluster: Cluster) -> tuple[dict[str, Any], PassStats]:
    """Sum every unit's int64 statistics; the sum does not depend on order or chunking."""
    method = get_method(job.config.method)
    params = job.config.method_params()
    stats = PassStats()
    start = time.perf_counter()
    total = torch.zeros((len(job.tasks) + 1, len(job.tasks) + 1), dtype=torch.int64)
    results = ordered_map(
        reduce_unit,
        job.units,
        (job.layout, job.storage, method, params),
        _workers(job.config, cluster),
        _resources(cluster),
    )
    for result in _progress(results, job, "reduce"):
        if result.stats is not None:
            total += result.stats
        stats.add(result.bytes_read, result.peak_rss_bytes)
    finalized = method.finalize(total, params)
    stats.wall_s = time.perf_counter() - start
    return finalized, stats


def _map_pass(
    job: Job, cluster: Cluster, finalized: dict[str, Any]
) -> tuple[PassStats, dict[str, str], int]:
    """Merge every unit and append its bytes to its shard, shards published one by one."""
    assert job.out is not None
    method = get_method(job.config.method)
    params = job.config.method_params()
    stats = PassStats()
    start = time.perf_counter()
    weight_map: dict[str, str] = {}
    total_size = 0
    writer: ShardWriter | None = None
    results = ordered_map(
        map_unit,
        job.units,
        (job.layout, job.storage, method, params, finalized),
        _workers(job.config, cluster),
        _resources(cluster),
    )
    try:
        for unit, result in zip(job.units, _progress(results, job, "map"), strict=True):
            if writer is None or writer.final_url != join(job.out, unit.shard):
                if writer is not None:
                    writer.commit()
                    stats.bytes_written += writer.written
                tensors = job.layout.out_tensors(unit.shard)
                writer = ShardWriter(job.out, unit.shard, tensors, job.storage)
            writer.write(memoryview(result.data))
            stats.add(result.bytes_read, result.peak_rss_bytes)
        if writer is not None:
            writer.commit()
            stats.bytes_written += writer.written
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    for shard in job.layout.shards:
        for tensor in job.layout.out_tensors(shard):
            weight_map[tensor.name] = shard
            total_size += tensor.nbytes
    stats.wall_s = time.perf_counter() - start
    return stats, weight_map, total_size


def _progress(results: Any, job: Job, name: str) -> Any:
    """A progress bar over work units on a terminal; silent in logs and cron jobs."""
    return tqdm(
        results, total=len(job.units), desc=name, unit="unit", disable=not sys.stderr.isatty()
    )


def _report(
    job: Job, finalized: dict[str, Any], passes: dict[str, Any], worker_rss: int
) -> dict[str, Any]:
    config = job.config
    tasks = [
        {"model": url, **{k: v for k, v in t.items()}}
        for url, t in zip(config.tasks, finalized["tasks"], strict=True)
    ]
    for t in tasks:
        if t["rho"] == float("inf"):
            t["rho"] = "inf"
    return {
        "ram_dist_version": __version__,
        "method": config.method,
        "parameters": _dataclass_dict(config.method_params()),
        "base": config.base,
        "out_dtype": config.out_dtype,
        "chunk_bytes": config.chunk_bytes,
        "elements": {
            "participating": finalized["participating"],
            "unchanged": finalized["unchanged"],
            "by_count": finalized["by_count"],
        },
        "tasks": tasks,
        "lambda_applied": finalized["lambdas"],
        "passes": passes,
        "memory": {
            "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "worker_peak_rss_bytes": worker_rss,
        },
    }


def _dataclass_dict(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
