"""The GPU workers: one long-lived Ray actor per GPU, for the whole job.

Ray gives an actor of `num_gpus=1` its GPU when the process starts (`CUDA_VISIBLE_DEVICES`)
and the actor keeps it for its whole life, with its CUDA context, torch's import and its
pinned buffers: no unit pays a process start, where a task per unit would (a process keeps
the CUDA context of the GPU it used first, so GPU tasks could not share processes). Each
worker runs `GPU_UNITS_AT_ONCE` units at a time, each thread with buffers of its own, so
that one reads while the other computes. A worker that dies is restarted by Ray (a new
process) and the units it held run again; one that cannot be replaced fails the job with a
line that says so.

A GPU worker also makes its units' LoRA products with torch on its GPU (`kernels.lora`'s
`compute_on`): r multiplies and adds per element, the same bytes as the CPU kernel's.

Without CUDA (Ray's fake GPUs in tests) a GPU worker computes the same eager rule, and the
same torch products, on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from ram_dist.engine.pool import Place, get_result, run_item
from ram_dist.errors import RamDistError
from ram_dist.planning.devices import GPU_UNITS_AT_ONCE, DeviceChoice

#: Times Ray restarts a GPU worker that died (its units run again each time).
RESTARTS = 5
#: Units sent to a worker beyond those it runs, so that it never waits on the driver.
QUEUED = GPU_UNITS_AT_ONCE


def exact_torch() -> None:
    """torch set to the spec's rounding on a GPU: no TF32 anywhere (the eager rule has no
    matrix product, but a method might). Elementwise ops are separate kernels, so no
    multiply and add are ever contracted into one FMA."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@ray.remote
class GpuWorker:
    """One GPU's worker process (see the module)."""

    def __init__(self) -> None:
        exact_torch()
        import torch

        from ram_dist.engine import worker
        from ram_dist.kernels import lora

        if torch.cuda.is_available():
            torch.cuda.init()  # the CUDA context, once, before the first unit
        lora.compute_on(worker.device())
        worker.warm_up()
        self._process = f"{socket.gethostname()}:{os.getpid()}"

    def where(self) -> tuple[str, str]:
        """This worker's node and process (`host:pid`)."""
        return ray.get_runtime_context().get_node_id(), self._process

    def run(
        self, fn: Callable[..., Any], item: Any, only_node: str | None, *shared: Any
    ) -> tuple[str, Any, str, float, float]:
        """`fn(item, *shared)`, with this worker's node and process and when it ran (this
        process's clock)."""
        started = time.time()
        node = ray.get_runtime_context().get_node_id()
        if only_node is not None and node != only_node:
            raise RamDistError(
                f"a GPU worker restarted on node {node}, but this part must be written on "
                f"node {only_node} (a local output folder): rerun to resume, or use "
                "--output-shared or --device cpu"
            )
        node, value = run_item(fn, item, *shared)
        return node, value, self._process, started, time.time()


@dataclass
class _Worker:
    handle: Any
    node: str
    in_flight: int = 0


class GpuWorkers:
    """The job's GPU workers, as a lane of `pool.unordered_map`: each takes up to
    `GPU_UNITS_AT_ONCE + QUEUED` items, the one on the item's node first."""

    def __init__(self, count: int, restarts: int = RESTARTS) -> None:
        options = {
            "num_gpus": 1, "num_cpus": 1, "max_concurrency": GPU_UNITS_AT_ONCE,
            "max_restarts": restarts, "max_task_retries": restarts,
        }  # fmt: skip
        handles = [GpuWorker.options(**options).remote() for _ in range(count)]  # type: ignore[attr-defined]
        self.restarts = restarts
        try:
            where = ray.get([h.where.remote() for h in handles])
        except ray.exceptions.RayError as e:
            for h in handles:
                ray.kill(h)
            raise RamDistError(f"the GPU workers did not start: {_cause(e)}") from None
        self._workers = [_Worker(h, node) for h, (node, _) in zip(handles, where, strict=True)]
        self.processes: set[str] = {p for _, p in where}
        """Every process that was a GPU worker of this job (a restart adds one)."""
        self._owner: dict[ray.ObjectRef, _Worker] = {}
        self._spans: dict[str, list[tuple[float, float]]] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def serves(self, place: Place | None) -> bool:
        return place is None or not place.only or any(w.node == place.node for w in self._workers)

    def has_room(self, place: Place | None) -> bool:
        return self._pick(place) is not None

    def _pick(self, place: Place | None) -> _Worker | None:
        """The least busy worker with room (on `place`'s node first; only there if `only`)."""
        room = [w for w in self._workers if w.in_flight < GPU_UNITS_AT_ONCE + QUEUED]
        if place is not None:
            there = [w for w in room if w.node == place.node]
            room = there if there or place.only else room
        return min(room, key=lambda w: w.in_flight, default=None)

    def submit(
        self, fn: Callable[..., Any], item: Any, shared: tuple[Any, ...], place: Place | None
    ) -> ray.ObjectRef:
        worker = self._pick(place)
        assert worker is not None, "submitted to a GPU lane without room"
        only = place.node if place is not None and place.only else None
        ref = worker.handle.run.remote(fn, item, only, *shared)
        worker.in_flight += 1
        self._owner[ref] = worker
        return ref

    def result(self, ref: ray.ObjectRef) -> tuple[str, Any]:
        worker = self._owner.pop(ref)
        worker.in_flight -= 1
        try:
            node, value, process, started, ended = get_result(ref)
        except ray.exceptions.RayActorError as e:
            raise RamDistError(
                f"a GPU worker (node {worker.node}) died and was not replaced after "
                f"{self.restarts} restart(s): {_cause(e)}"
            ) from None
        worker.node = node  # where it runs now (a restart may move it)
        self.processes.add(process)
        self._spans.setdefault(process, []).append((started, ended))
        return node, value

    def forget(self, ref: ray.ObjectRef) -> None:
        worker = self._owner.pop(ref, None)
        if worker is not None:
            worker.in_flight -= 1

    def busy_share(self, wall_s: float) -> float:
        """The share of `wall_s` (a pass) the workers spent running units (a worker with two
        at once is busy once), since the last call."""
        busy = sum(_union(spans) for spans in self._spans.values())
        self._spans = {}
        if wall_s <= 0 or not self._workers:
            return 0.0
        return min(1.0, busy / (wall_s * len(self._workers)))

    def close(self) -> None:
        for w in self._workers:
            ray.kill(w.handle)


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _cause(e: BaseException) -> str:
    """A Ray error's first line."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass
class Devices:
    """Where a job's tasks run: its device choice, and the GPU workers it asked for."""

    choice: DeviceChoice
    gpu: GpuWorkers | None = None

    def on_gpu(self, units: Any) -> bool:
        return self.gpu is not None and self.choice.on_gpu(units)


@contextlib.contextmanager
def job_devices(choice: DeviceChoice, restarts: int = RESTARTS) -> Iterator[Devices]:
    """`Devices` for a job, its GPU workers (if its `choice` uses GPUs) alive until it ends."""
    gpu = GpuWorkers(choice.gpus, restarts) if choice.uses_gpus else None
    try:
        yield Devices(choice, gpu)
    finally:
        if gpu is not None:
            gpu.close()
