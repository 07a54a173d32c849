"""Counters of one pass (`PassStats`), for the report: units, bytes, where they ran."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ram_dist.engine import memory
from ram_dist.engine.timeline import PassTimeline
from ram_dist.engine.unit_results import PrecisionCounts, UnitResult
from ram_dist.io.range_cache import CacheTraffic


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
    lora_formed: int = 0
    """Elements of LoRA task values whose product the pass formed (all rounds)."""
    lora_reused: int = 0
    """Elements of LoRA task values the pass took as an earlier pass kept them."""
    cache_bytes_read: int = 0
    cache_bytes_written: int = 0
    units_per_node: dict[str, int] = field(default_factory=dict)
    units_sent_back: int = 0
    """Units sent to the node that read them first (where the cache holds their bytes)."""
    units_ran_there: int = 0
    first_node: dict[int, str] = field(default_factory=dict)
    """Per unit index, the node that first read it (not reported)."""
    parts: int = 0
    """Map pass: output parts made (each by one task, of one or more units)."""
    parts_reused: int = 0
    """Map pass: parts of resumed shards already in place, not made again."""
    output_path: str | None = None
    """Map pass: `direct` (workers write the output) or `through-driver`, and why."""
    output_path_reason: str = ""
    bytes_written_by_workers: int = 0
    bytes_written_by_driver: int = 0
    work_items: int = 0
    """Work items the pass ran, each a call of its task function: a reduce round's group of
    units or a map part (report key `tasks`, kept for the schema's readers); consecutive
    small ones share a Ray task (`pool.Batching`)."""
    work_retried: int = 0
    """Work items run again because their Ray task's attempt was lost with its worker or node
    (report key `tasks_retried`): each item of a batch that ran again counts."""
    work_on_gpu: int = 0
    """Ray tasks that ran on a GPU worker, see `planning.devices` (report key `tasks_on_gpu`)."""
    units_on_cpu: int = 0
    units_on_gpu: int = 0
    gpu_ids: set[str] = field(default_factory=set)
    workers: set[str] = field(default_factory=set)
    """The worker processes (`host:pid`) that ran the tasks."""
    gpu_workers: set[str] = field(default_factory=set)
    """Those of them that were GPU workers."""
    gpu_busy_share: float | None = None
    """The share of the pass's wall time the GPU workers spent on units (None: none ran)."""
    driver_memory: memory.PeakMemory = field(default_factory=memory.PeakMemory)
    """The driver's own peak during the pass (the process that receives the results)."""
    precision: PrecisionCounts | None = None
    """Reduce pass: the first round's precision check (`kernels.precision`), when it ran
    (not reported with the pass: the report has its own key)."""
    backward: bool = False
    """Whether the pass (its last reduce round) read the units from the last to the first.
    Each pass reads in the opposite order of the one before it, the first backwards: what
    the page cache keeps of inputs larger than it is the end of what was read last, where
    the next pass begins (before the first, the inputs were most likely written or read
    front to back: downloaded, copied, checked)."""
    rounds_read: int = 0
    """Reduce rounds that read (not reported)."""
    kernels_compiled: Counter[str] = field(default_factory=Counter)
    """Kernel signatures the pass's tasks compiled, per kernel, summed over the workers."""
    timeline: PassTimeline = field(default_factory=PassTimeline)
    """Where the workers' time went (`engine.timeline`), from the tasks' clocks."""

    def ran(
        self, indices: Sequence[int], node: str, traffic: CacheTraffic, sent_to: str | None
    ) -> None:
        """Where the units of one task ran, and what the task read from and wrote to the
        cache there."""
        self.cache_bytes_read += traffic.read
        self.cache_bytes_written += traffic.written
        self.units_per_node[node] = self.units_per_node.get(node, 0) + len(indices)
        for index in indices:
            self.first_node.setdefault(index, node)
        if sent_to is not None:
            self.units_sent_back += len(indices)
            self.units_ran_there += len(indices) * (node == sent_to)

    def add(self, result: UnitResult, units: int = 1, node: str = "") -> None:
        bytes_read = result.bytes_read
        times = result.times
        if times is not None and result.worker:
            thread = f"/{times.thread}" if times.thread else ""
            self.timeline.add(result.worker + thread, node, times)
        self.units += units
        self.work_items += 1
        self.work_retried += result.attempt > 0
        self.work_on_gpu += bool(result.gpus)
        self.gpu_ids.update(result.gpus)
        if result.gpus:
            self.units_on_gpu += units
        else:
            self.units_on_cpu += units
        if result.worker:
            self.workers.add(result.worker)
            if result.gpus:
                self.gpu_workers.add(result.worker)
        self.fused_elements += result.fused_elements
        self.lora_formed += result.lora_formed
        self.lora_reused += result.lora_reused
        self.kernels_compiled.update(result.kernels_compiled)
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
        out = {
            "units": self.units,
            "wall_s": round(self.wall_s, 4),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "max_unit_bytes_read_per_input": self.max_unit_bytes_read,
            "fused_elements": self.fused_elements,
            "lora_products": {"formed": self.lora_formed, "reused": self.lora_reused},
            "kernels_compiled": dict(sorted(self.kernels_compiled.items())),
            "bytes_fetched": self.bytes_read - self.cache_bytes_read,
            "cache_bytes_read": self.cache_bytes_read,
            "cache_bytes_written": self.cache_bytes_written,
            "units_per_node": dict(self.units_per_node),
            "units_sent_back": self.units_sent_back,
            "units_ran_there": self.units_ran_there,
            "tasks": self.work_items,
            "tasks_retried": self.work_retried,
            "tasks_on_gpu": self.work_on_gpu,
            "gpu_ids": sorted(self.gpu_ids),
            "worker_processes": len(self.workers),
            "units_on_cpu": self.units_on_cpu,
            "units_on_gpu": self.units_on_gpu,
            "gpu_worker_processes": len(self.gpu_workers),
            "gpu_busy_share": (
                None if self.gpu_busy_share is None else round(self.gpu_busy_share, 4)
            ),
        }
        out["backward"] = self.backward
        out["timeline"] = self.timeline.as_dict()
        if self.output_path is not None:
            out.update(
                {
                    "parts": self.parts,
                    "parts_reused": self.parts_reused,
                    "output_path": self.output_path,
                    "output_path_reason": self.output_path_reason,
                    "bytes_written_by_workers": self.bytes_written_by_workers,
                    "bytes_written_by_driver": self.bytes_written_by_driver,
                }
            )
        return out
