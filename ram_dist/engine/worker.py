"""Where a task runs and what a worker keeps between tasks: the GPU Ray gave it, the device
it computes on, whether the fused kernels apply, and the reused buffers of each worker thread.
Runs on Ray workers (or inline in tests)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from ram_dist import kernels
from ram_dist.engine import collector, ray_private
from ram_dist.engine.kept_values import KeptValues, ProductCount
from ram_dist.engine.memory import PeakMemory
from ram_dist.engine.timeline import TaskClock
from ram_dist.io.range_cache import Traffic
from ram_dist.kernels import shared_cache

if TYPE_CHECKING:
    from ram_dist.io.storage import Storage
    from ram_dist.methods import MergeMethod
    from ram_dist.methods.protocol import State, TensorParams
    from ram_dist.planning.layout import Layout


def given_gpus() -> tuple[str, ...] | None:
    """The GPU ids Ray gave the running Ray task (empty when it gave none); None outside a Ray
    worker process (the driver, or a test calling the work inline)."""
    if not ray.is_initialized():
        return None
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return tuple(str(g) for g in ray.get_gpu_ids())


def device() -> str:
    """ "cuda" when this task was given a GPU, else "cpu": the bytes are the same. A Ray
    task given no GPU computes on the CPU, with the fused kernels, even where CUDA is
    visible (Ray leaves CUDA_VISIBLE_DEVICES alone for it: `--device cpu` on a GPU node),
    and without importing torch; outside Ray, the GPU whenever torch sees one."""
    if given_gpus() == ():
        return "cpu"
    try:
        import torch
    except ImportError:  # a CPU-only install without torch: the fused path needs none
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def ran_by() -> dict[str, Any]:
    """What a task's result says of where and how it ran (`UnitResult.gpus`, `worker`,
    `attempt`, `kernels_compiled`)."""
    return {
        "gpus": given_gpus() or (),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "attempt": _attempt(),
        "kernels_compiled": shared_cache.take_compiled(),
    }


def _attempt() -> int:
    """The running task's attempt number (0 outside a Ray task): Ray has no public call for
    it (`ray_private.task_attempt`)."""
    if given_gpus() is None:
        return 0
    return ray_private.task_attempt()


def warm_up() -> None:
    """Ready this worker process for the passes' tasks (`runtime.warm_workers`): this module
    and its imports are loaded by now; load the fused kernels' modules and numba's lowering
    registries too, which the first kernel call would otherwise load (about half a second),
    cached or not."""
    if not kernels.available():
        return
    from numba.core.registry import cpu_target

    from ram_dist.kernels import ram_numba, ties_numba  # noqa: F401

    cpu_target.target_context.refresh()


class _ReadBuffers:
    """Two reusable read buffers (the block being computed and the one being read): fresh
    memory would be faulted in, and zeroed by the kernel, for every block, which costs as
    much as the copy out of the page cache. For a GPU task they are pinned (torch), so that
    copies to the device can run asynchronously."""

    ALIGN = 64

    def __init__(self) -> None:
        self._slots: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * 2
        self._pinned = [False, False]
        self._floats: dict[tuple[int, int], np.ndarray] = {}

    def floats(self, key: tuple[int, int], size: int) -> np.ndarray:
        """A reusable float32 array of `size` under `key` (read slot, input): the values of
        an FP8 input once dequantized, valid as long as that slot's bytes are."""
        held = self._floats.get(key)
        if held is None or held.size < size:
            self._floats.pop(key, None)  # let the old one go first
            held = self._floats[key] = np.empty(size, dtype=np.float32)
        return held[:size]

    def views(self, slot: int, sizes: list[int], pinned: bool) -> list[np.ndarray]:
        """Byte arrays of `sizes`, each starting `ALIGN`-aligned, valid until the next call
        for this slot."""
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // self.ALIGN) * self.ALIGN
        if self._slots[slot].size < total or self._pinned[slot] != pinned:
            self._slots[slot] = np.empty(0, dtype=np.uint8)  # let the old one go first
            self._slots[slot] = _pinned_bytes(total) if pinned else _aligned_bytes(total)
            self._pinned[slot] = pinned
        whole = self._slots[slot]
        return [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def _aligned_bytes(size: int) -> np.ndarray:
    """`size` bytes starting on a 64-byte boundary (numpy only promises 16)."""
    raw = np.empty(size + _ReadBuffers.ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ReadBuffers.ALIGN
    return raw[skip : skip + size]


def _pinned_bytes(size: int) -> np.ndarray:
    import torch

    return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()


class _OutputBuffer:
    """A map unit's output bytes, reused by the next unit of the same worker process. Fresh
    memory for every unit is faulted in page by page, which costs about twice the merge
    itself; reuse is safe only where the caller is done with a unit's bytes before it asks
    for the next unit's, as a Ray task is (its return value is copied into the object store
    before the worker takes another task)."""

    def __init__(self) -> None:
        self._data: list[np.ndarray] = []

    def take(self, size: int, slot: int = 0) -> np.ndarray:
        """`size` bytes of buffer `slot` (a sweep's map task makes one output per variant,
        each into a slot of its own)."""
        while len(self._data) <= slot:
            self._data.append(np.empty(0, dtype=np.uint8))
        if self._data[slot].size < size:
            self._data[slot] = np.empty(0, dtype=np.uint8)  # let the old one go first
            self._data[slot] = _aligned_bytes(size)
        return self._data[slot][:size]


@dataclass
class WorkScope:
    """What one task uses of its worker's context: the reused buffers, the process's
    peak-memory sampler, the task's own input-cache traffic counters and its clock (the
    pass's timeline)."""

    reads: _ReadBuffers
    output: _OutputBuffer
    memory: PeakMemory
    traffic: Traffic
    clock: TaskClock
    kept: KeptValues | None = None
    """Where the task keeps and finds LoRA task values (`engine.kept_values`); None: never."""
    products: ProductCount = field(default_factory=ProductCount)
    """The LoRA task values the task formed and took as kept, in elements."""


class WorkerContext:
    """What a worker thread keeps from one task to the next: its read and output buffers
    (reused: fresh memory costs page faults) and its process's peak memory (a unit reports
    the process's peak so far: samples are rate-limited, and a small unit may take none).
    Each task enters `work()`, which gives it these with fresh traffic counters. A CPU worker
    runs one task at a time (Ray's default for tasks); a GPU worker runs one per thread
    (`engine.gpu`), each thread with a context of its own. A second task entering the same
    context at once is an error rather than two tasks sharing buffers."""

    def __init__(self, memory: PeakMemory) -> None:
        self._reads = _ReadBuffers()
        self._output = _OutputBuffer()
        self._memory = memory
        self._busy = threading.Lock()

    @contextlib.contextmanager
    def work(self) -> Iterator[WorkScope]:
        """The Ray task's scope, with Python's cyclic garbage collector paused
        (`collector.paused`): a unit of many small tensors makes objects by the hundred
        thousand, and each full collection would scan them all again, and the job's layout;
        a task makes no reference cycles to speak of, and they are collected after it."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a worker context runs one task at a time")
        try:
            with collector.paused():
                yield WorkScope(self._reads, self._output, self._memory, Traffic(), TaskClock())
        finally:
            self._busy.release()


_THREAD = threading.local()


_PROCESS_MEMORY: list[PeakMemory] = []


_PROCESS_LOCK = threading.Lock()


def worker_context() -> WorkerContext:
    """This thread's worker context, made on first use; it lives as long as the thread (a Ray
    worker's, or one of a GPU worker's), so that its next task reuses its buffers."""
    context = getattr(_THREAD, "context", None)
    if context is None:
        with _PROCESS_LOCK:
            if not _PROCESS_MEMORY:
                _PROCESS_MEMORY.append(PeakMemory())
        context = _THREAD.context = WorkerContext(_PROCESS_MEMORY[0])
    return context


@dataclass(frozen=True)
class WorkFlags:
    """The engine's own settings for a pass's work, shipped beside the method's state and
    never inside it (the state is the method's alone, kept in the manifest): whether the
    fused kernels are on for the job (`--kernels`), and the bits torch gives a NaN cast to
    bfloat16 (probed on the driver, so that a worker need not import torch; None: the kernel
    probes where it runs). The default is the eager path. `kept`: where the pass keeps and
    finds LoRA task values (`engine.kept_values`), None: nowhere."""

    fused: bool = False
    bf16_nan: int | None = None
    kept: KeptValues | None = None


#: The eager path's flags: fused kernels off.
EAGER = WorkFlags()


@dataclass(frozen=True)
class TaskContext:
    """What every task of a pass reads, the same for all of them: the job's layout, the
    storage it reads through, the method, each tensor's parameters, the method's state and
    the engine's flags. Shipped once per pass; the layout and the parameters may be
    `pool.Shared` values there, which the worker resolves before the task runs."""

    layout: Layout
    storage: Storage
    method: MergeMethod
    params: Mapping[str, TensorParams]
    state: State
    flags: WorkFlags = EAGER


@dataclass(frozen=True)
class Fused:
    """Whether a task's chunks may go to the method's fused kernels: kernels on for the job
    (`WorkFlags.fused`, from `--kernels`), a CPU task (a GPU worker runs the eager rule, on
    the CPU where CUDA is absent), and numba installed. Per chunk, the inputs' dtypes (and
    the output's) must be ones the kernels handle, and the method may still decline."""

    on: bool

    @classmethod
    def of(cls, flags: WorkFlags, dev: str) -> Fused:
        cpu_task = dev == "cpu" and not given_gpus()
        return cls(flags.fused and cpu_task and kernels.available())

    def take(self, dtypes: Sequence[str], out: str | None = None) -> bool:
        return self.on and _handles(tuple(dtypes), out)


@functools.lru_cache(maxsize=256)
def _handles(dtypes: tuple[str, ...], out: str | None) -> bool:
    """`kernels.handle`, asked once per dtypes (it is asked for every block)."""
    return kernels.handle(dtypes, out)
