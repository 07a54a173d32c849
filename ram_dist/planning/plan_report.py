"""What `ram-dist plan` reports: every up-front check passed, what a merge of the job would
read, run and write. Headers only, and writes nothing anywhere (a remote output's
writability is not probed by a plan).

Pure, without Ray: the engine gives the size of the Ray this process is connected to, if
any (`ConnectedCluster`). Without one, the cluster is this machine when a merge would start
an embedded Ray there, else not known until a merge connects to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ram_dist.dtypes import itemsize
from ram_dist.planning.input_cache import cache_report, choose_input_cache
from ram_dist.planning.job import Job
from ram_dist.planning.layout import unit_out_bytes
from ram_dist.planning.output_state import check_writable, open_output, output_sink_for
from ram_dist.planning.sizing import COMPUTE_BLOCK, machine
from ram_dist.settings import ray_address

#: How `plan` says what `--device` would do on a cluster it cannot see.
UNKNOWN_CLUSTER_DEVICE = {
    "auto": "every CPU with the fused kernels; on a cluster with GPUs, the units of tensors "
    "that need the eager rule or have LoRA products to compute on one worker per GPU: known "
    "once a merge connects to it",
    "cpu": "one unit per CPU of the cluster",
    "cuda": "every unit on one worker per GPU; a cluster without GPUs is refused when a merge "
    "connects",
}


@dataclass(frozen=True)
class ConnectedCluster:
    """What Ray says of the cluster this process is connected to."""

    gpus: int
    cpus: int
    memory: int
    """Bytes of Ray's `memory` resource."""


def plan_report(job: Job, connected: ConnectedCluster | None) -> dict[str, Any]:
    """The plan of a prepared job, on the cluster the engine is `connected` to (None: none)."""
    config = job.config
    device, cluster = planned_device(job, connected)
    if cluster is not None:
        job = job.replanned(*cluster)
    out: dict[str, Any] = {"output": None, "device": device}
    if job.out is not None:
        found = open_output(job)
        if job.storage.is_local(job.out):
            check_writable(job)
        out["output"] = {
            "url": job.out,
            "state": "complete" if found.finished else "resume" if found.resumed else "new",
            "shards": list(job.layout.shards),
            "shards_finished": sorted(found.manifest.shards) if found.resumed else [],
        }
        sink = output_sink_for(job, nodes=1 if _embedded(job) else None)
        out["output"].update({"path": sink.path, "path_reason": sink.reason})
    participating = [n for n, e in job.layout.tensors.items() if e.participating]
    merging = set(participating)
    merge_bytes = job.pass_bytes(merging)
    out.update(
        {
            "method": job.method.name,
            "parameters": job.effective_parameters(),
            "inputs": job.identity()["inputs"],
            "formats": job.formats(),
            "integers_from_base": {
                "allowed": config.integers_from_base,
                "copied_though_changed": list(job.integers_changed),
            },
            "extra_tensors": job.extra_tensors(),
            "tensors": {
                "merged": len(participating),
                "copied": len(job.layout.tensors) - len(participating),
                "elements_merged": sum(job.layout.tensors[n].numel for n in participating),
            },
            "work_units": len(job.units),
            "unit_budget_bytes": job.unit_budget_bytes,
            "bytes_per_pass": {
                "reduce_round": merge_bytes,
                "reduce_rounds": job.reduce_rounds,
                "reduce_rounds_note": job.method.rounds_note,
                "map": job.pass_bytes(),
            },
            "memory_per_worker_bytes": worker_memory(job),
            "input_cache": cache_report(job, *choose_input_cache(job)),
        }
    )
    return out


def worker_memory(job: Job) -> int:
    """The data a worker holds at once, at most: two read blocks (at most `COMPUTE_BLOCK`
    elements of every input, an FP8 input's also dequantized), its unit's merged bytes (one
    buffer per output: a sweep's variants), and float temporaries of one block on the eager
    path."""
    units = job.units
    out_bytes = max((unit_out_bytes(u, job.layout) for u in units), default=0)
    largest = max((job.unit_bytes(u) for u in units), default=0)
    widest = max(
        (s.itemsize + (itemsize(s.values_dtype) if s.decoded else 0)
         for e in job.layout.tensors.values() for s in e.sources), default=1,
    )  # fmt: skip
    blocks = min(math.ceil(2 * COMPUTE_BLOCK * widest * (len(job.tasks) + 1)), 2 * largest)
    temporaries = min(COMPUTE_BLOCK, largest) * 8 * (len(job.tasks) + 4)
    return blocks + out_bytes * job.outputs + temporaries


def planned_device(
    job: Job, connected: ConnectedCluster | None
) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The device a merge would choose (`Job.device_choice`) and why, with the slots and
    memory to plan units for; None for those where the cluster is not known without
    connecting to it. The cluster is the Ray this process is `connected` to, else, with no
    address, this machine (where a merge starts an embedded Ray)."""
    config = job.config
    if connected is not None:
        gpus, cpus, memory = connected.gpus, connected.cpus, connected.memory
        where = "the Ray this process is connected to"
    elif _embedded(job):
        import torch

        (cpus, memory), gpus = machine(), torch.cuda.device_count()
        where = "this machine (a merge starts an embedded Ray)"
    else:
        how = UNKNOWN_CLUSTER_DEVICE[config.device]
        device = None if config.device == "auto" else config.device
        return {
            "requested": config.device, "device": device, "gpus": None, "cpu_slots": None,
            "slots": None, "reason": f"--device {config.device}: {how}", "cluster": None,
        }, None  # fmt: skip
    choice = job.device_choice(gpus, cpus)  # cuda without GPUs: refused here too
    return {**choice.as_dict(), "cluster": where}, (choice.slots, memory)


def _embedded(job: Job) -> bool:
    """Whether a merge of the job starts an embedded Ray (no address given)."""
    return ray_address(job.config.address) is None
