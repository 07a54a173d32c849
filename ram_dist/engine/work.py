"""What a worker does with one work unit. Runs on Ray workers (or inline in tests).

A unit's pieces are read as byte ranges of every input it needs into numpy arrays, without
parsing anything else, handed to the merge method, and (map pass) written in the output
dtype as raw little-endian bytes, ready to append to the output shard.

A CPU worker on the fused path (the method's kernels take the chunk) never imports torch:
the kernels read and write the numpy arrays. torch is loaded where the eager rule or a GPU
runs, the first time it does.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from ram_dist import kernels
from ram_dist.dtypes import itemsize
from ram_dist.engine.layout import Layout, Source, TensorEntry
from ram_dist.engine.memory import PeakMemory, peak_rss
from ram_dist.io.range_cache import CacheTraffic, Traffic
from ram_dist.io.sinks import PartReceipt, ShardTarget
from ram_dist.io.storage import Storage
from ram_dist.kernels import fp8
from ram_dist.methods import MergeMethod
from ram_dist.methods.registry import Chunk, State, TensorParams
from ram_dist.units import Part, Piece, WorkUnit

if TYPE_CHECKING:
    import torch

#: Elements computed at once; bounds a worker's float temporaries (about 40 bytes each).
COMPUTE_BLOCK = 1 << 22


@dataclass(frozen=True)
class UnitResult:
    """What a unit sends back: statistics or output bytes, plus what it cost."""

    index: int
    stats: dict[str, np.ndarray] | None
    """Reduce pass: the method's int64 statistics by key, summed over the unit's pieces."""
    data: np.ndarray | None
    bytes_read: tuple[int, ...]
    peak_rss_bytes: int
    nonfinite: dict[str, list[int]] | None = None
    """Reduce round 0: per tensor, NaN and Inf counts of each input (base first), when any."""
    fused_elements: int = 0
    """Map pass: elements merged by a fused kernel rather than the eager torch rule."""
    peak_private_bytes: int = 0
    """This worker's peak memory without Ray's shared object-store pages (`memory`)."""
    receipt: PartReceipt | None = None
    """Map pass: the part written (and its bytes, on the through-driver path)."""
    gpus: tuple[str, ...] = ()
    """The Ray GPU ids the task held (none: a CPU task, or run outside Ray)."""
    worker: str = ""
    """The process that ran the task: `host:pid`."""
    attempt: int = 0
    """Ray's attempt number of the task: above 0 when an earlier attempt was lost (its worker
    or node died) and Ray ran it again."""
    traffic: CacheTraffic = field(default_factory=CacheTraffic)
    """Bytes the task read from this node's input cache and wrote to it."""


class Statistics(dict[str, np.ndarray]):
    """A reduce task's statistics by key, as a dict, pickled compactly: the arrays of one
    shape and dtype stacked into one, so that the statistics of 100k small tensors cross
    Ray as a few buffers rather than 100k (two seconds each way)."""

    def __reduce__(self) -> tuple[Any, ...]:
        kinds: dict[tuple[Any, ...], int] = {}
        which: list[int] = []
        stacks: list[list[np.ndarray]] = []
        for value in self.values():
            kind = kinds.setdefault((value.shape, value.dtype.str), len(kinds))
            if kind == len(stacks):
                stacks.append([])
            stacks[kind].append(value)
            which.append(kind)
        return (_statistics, (list(self), which, [np.stack(s) for s in stacks]))


def _statistics(keys: list[str], which: list[int], stacks: list[np.ndarray]) -> Statistics:
    rows = [_rows(stack) for stack in stacks]
    return Statistics(zip(keys, (next(rows[k]) for k in which), strict=True))


def _rows(stack: np.ndarray) -> Iterator[np.ndarray]:
    """The arrays stacked in `stack` (0-d ones too: iterating a 1-d array gives scalars)."""
    return (row.reshape(stack.shape[1:]) for row in stack.reshape(len(stack), -1))


def task_gpus() -> tuple[str, ...] | None:
    """The GPU ids Ray gave the running task (empty when it gave none); None outside a Ray
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
    if task_gpus() == ():
        return "cpu"
    try:
        import torch
    except ImportError:  # a CPU-only install without torch: the fused path needs none
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _ran_by() -> dict[str, Any]:
    """What a task's result says of where and how it ran (`UnitResult.gpus`, `worker`,
    `attempt`)."""
    return {
        "gpus": task_gpus() or (),
        "worker": f"{socket.gethostname()}:{os.getpid()}",
        "attempt": _attempt(),
    }


def _attempt() -> int:
    """The running task's attempt number (0 outside a Ray task). Ray has no public call for
    it; its core worker does, and 0 is the answer when that ever changes."""
    if task_gpus() is None:
        return 0
    core = getattr(ray._private.worker.global_worker, "core_worker", None)
    get = getattr(core, "get_current_task_attempt_number", None)
    try:
        return int(get()) if get is not None else 0
    except Exception:  # noqa: BLE001  (a private call: never let it fail a task)
        return 0


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


def _inputs_of(entry: TensorEntry) -> int:
    """Inputs a tensor reads: all (merged), the base (copied), none (new FP8 scales)."""
    if entry.scale_of is not None:
        return 0
    return len(entry.sources) if entry.participating else 1


def _ranges(entry: TensorEntry, start: int, stop: int) -> list[tuple[str, int, int]]:
    """The byte ranges of elements [start, stop) of a tensor in every input it needs (base
    first; only the base for a tensor that is copied), then the scale rows of the bands
    they cover in each FP8 input (elements [start, stop) are whole bands there)."""
    sources = entry.sources[: _inputs_of(entry)]
    out = []
    for src in sources:
        size = itemsize(src.dtype)
        out.append((src.file, src.start + start * size, src.start + stop * size))
    for src in sources:
        if src.scales is not None:
            first, last = _band_span(entry, start, stop)
            width, per = itemsize(src.scales.dtype), src.scales.per_band
            lo, hi = src.scales.start + first * per * width, src.scales.start + last * per * width
            out.append((src.scales.file, lo, hi))
    return out


def _band_span(entry: TensorEntry, start: int, stop: int) -> tuple[int, int]:
    """The bands [first, last) that elements [start, stop) of an FP8 weight cover."""
    band = entry.band
    assert band is not None and start % band == 0, f"{entry.name}: not cut at a band"
    return start // band, -(-stop // band)


def _input_count(layout: Layout) -> int:
    return max(len(e.sources) for e in layout.tensors.values())


@dataclass(frozen=True)
class Block:
    """Elements [lo, hi) of one piece of a unit: what is read and computed at once."""

    piece: int
    lo: int
    hi: int


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
        self._data = np.empty(0, dtype=np.uint8)

    def take(self, size: int) -> np.ndarray:
        if self._data.size < size:
            self._data = np.empty(0, dtype=np.uint8)  # let the old one go first
            self._data = _aligned_bytes(size)
        return self._data[:size]


@dataclass
class TaskScope:
    """What one task uses of its worker's context: the reused buffers, the process's
    peak-memory sampler, and the task's own input-cache traffic counters."""

    reads: _ReadBuffers
    output: _OutputBuffer
    memory: PeakMemory
    traffic: Traffic


class WorkerContext:
    """What a worker thread keeps from one task to the next: its read and output buffers
    (reused: fresh memory costs page faults) and its process's peak memory (a unit reports
    the process's peak so far: samples are rate-limited, and a small unit may take none).
    Each task enters `task()`, which gives it these with fresh traffic counters. A CPU worker
    runs one task at a time (Ray's default for tasks); a GPU worker runs one per thread
    (`engine.gpu`), each thread with a context of its own. A second task entering the same
    context at once is an error rather than two tasks sharing buffers."""

    def __init__(self, memory: PeakMemory) -> None:
        self._reads = _ReadBuffers()
        self._output = _OutputBuffer()
        self._memory = memory
        self._busy = threading.Lock()

    @contextlib.contextmanager
    def task(self) -> Iterator[TaskScope]:
        """The task's scope, with Python's cyclic garbage collector paused (`_collector_paused`)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a worker context runs one task at a time")
        try:
            with _collector_paused():
                yield TaskScope(self._reads, self._output, self._memory, Traffic())
        finally:
            self._busy.release()


_PAUSES = [0, False]  # tasks running with the collector paused; whether it ran before
_PAUSES_LOCK = threading.Lock()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while any task of this process runs: a unit of
    many small tensors makes objects by the hundred thousand (blocks, statistics), and each
    full collection would scan them all again, and the job's layout (a third of the time of
    a unit of 100k tensors). A task makes no reference cycles to speak of; they are collected
    after it. Counted, so that a GPU worker's second thread does not turn it back on under
    the first."""
    with _PAUSES_LOCK:
        if _PAUSES[0] == 0:
            _PAUSES[1] = gc.isenabled()
            gc.disable()
        _PAUSES[0] += 1
    try:
        yield
    finally:
        with _PAUSES_LOCK:
            _PAUSES[0] -= 1
            if _PAUSES[0] == 0 and _PAUSES[1]:
                gc.enable()


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
class BlockInputs:
    """One block's inputs as read (base first; only the base for a tensor that is copied):
    each input's bytes, as a byte array over the read buffer, and its safetensors dtype. The
    arrays are valid until the block after the next is read."""

    raw: tuple[np.ndarray, ...]
    dtypes: tuple[str, ...]
    fp8: tuple[tuple[np.ndarray, np.ndarray] | None, ...] = ()
    """Per input read as FP8: its e4m3 bytes and raw scale bytes (`raw` holds its values,
    dequantized to float32); None for any other input."""

    def arrays(self) -> list[np.ndarray]:
        """The inputs as the fused kernels read them (`ram_dist.kernels.READS`)."""
        return [r.view(kernels.READS[d]) for r, d in zip(self.raw, self.dtypes, strict=True)]

    def tensors(self, dev: str) -> list[torch.Tensor]:
        """The inputs as torch tensors on `dev`, for the eager rule (this imports torch)."""
        return [
            _tensor_from_bytes(r, d).to(dev, non_blocking=True)
            for r, d in zip(self.raw, self.dtypes, strict=True)
        ]


#: A tensor that reads at most this many bytes from each input is small (`_groupable`).
SMALL_BYTES = 64 * 2**10
#: Blocks of small tensors read together: at most this many, of at most `GROUP_BYTES` in all.
GROUP_BLOCKS = 4096
GROUP_BYTES = 4 * 2**20


def _groupable(entry: TensorEntry) -> bool:
    """Whether a tensor's blocks may be read together with their neighbours' (one
    `read_ranges` call for the group): a small tensor, at most `SMALL_BYTES` from each input.
    A block of a tensor that is not is read on its own, and so is every block of a weight in
    FP8 blocks (its scales are read with it, its values dequantized) and of new FP8 scales
    (made from their weight's bands)."""
    if entry.scale_of is not None or entry.band is not None:
        return False
    return all(entry.numel * itemsize(s.dtype) <= SMALL_BYTES for s in entry.sources)


def _groups(blocks: list[Block], pieces: tuple[Piece, ...], layout: Layout) -> list[range]:
    """`blocks` cut into runs read at once: consecutive blocks of small tensors (at most
    `GROUP_BLOCKS`, `GROUP_BYTES`), every other block alone."""
    groups: list[range] = []
    first, size, small = 0, 0, False
    for k, block in enumerate(blocks):
        entry = layout.tensors[pieces[block.piece].tensor]
        if not _groupable(entry):
            groups += [range(first, k)] if small else []
            groups.append(range(k, k + 1))
            first, size, small = k + 1, 0, False
            continue
        nbytes = (block.hi - block.lo) * sum(
            itemsize(src.dtype) for src in entry.sources[: _inputs_of(entry)]
        )
        if small and (k - first >= GROUP_BLOCKS or size + nbytes > GROUP_BYTES):
            groups.append(range(first, k))
            first, size = k, 0
        size += nbytes
        small = True
    if small:
        groups.append(range(first, len(blocks)))
    return groups


def stream_blocks(
    pieces: tuple[Piece, ...],
    layout: Layout,
    storage: Storage,
    bytes_read: list[int],
    scope: TaskScope,
    pinned: bool = False,
) -> Iterator[tuple[Block, BlockInputs]]:
    """Each compute block of `pieces` with its inputs, in order. A thread reads the next
    group of blocks (`_groups`: small tensors together, in one `read_ranges` call) while the
    caller computes this one's (reads and the fused kernels release the GIL), into one of
    the scope's two read buffers: a block's inputs are valid until the caller asks for the
    block after it. `bytes_read[i]` grows by what is read from input i."""
    blocks = [
        Block(p, lo, hi)
        for p, piece in enumerate(pieces)
        for lo, hi in _blocks(piece.numel, layout.tensors[piece.tensor])
    ]
    groups = _groups(blocks, pieces, layout)

    def read_one(k: int, slot: int) -> BlockInputs:
        """A block read on its own, an FP8 one dequantized."""
        block = blocks[k]
        piece = pieces[block.piece]
        entry = layout.tensors[piece.tensor]
        sources = entry.sources[: _inputs_of(entry)]
        if not sources:  # new FP8 scales: made from their weight's bands, read nothing
            return BlockInputs((), ())
        start, stop = piece.start + block.lo, piece.start + block.hi
        requests = _ranges(entry, start, stop)
        arrays = scope.reads.views(slot, [end - start for _, start, end in requests], pinned)
        storage.read_ranges(requests, into=[memoryview(a) for a in arrays], traffic=scope.traffic)
        scaled = [i for i, s in enumerate(sources) if s.scales is not None]
        for i, a in enumerate(arrays):
            bytes_read[i if i < len(sources) else scaled[i - len(sources)]] += a.size
        if not scaled:
            return BlockInputs(tuple(arrays), tuple(s.dtype for s in sources))
        return _dequantized(sources, arrays, scaled, lambda i, n: scope.reads.floats((slot, i), n))

    def read(g: int) -> list[BlockInputs]:
        if len(groups[g]) == 1:
            return [read_one(groups[g][0], g % 2)]
        requests: list[tuple[str, int, int]] = []
        dtypes: list[tuple[str, ...]] = []
        for block in (blocks[k] for k in groups[g]):
            piece = pieces[block.piece]
            entry = layout.tensors[piece.tensor]
            requests += _ranges(entry, piece.start + block.lo, piece.start + block.hi)
            dtypes.append(tuple(s.dtype for s in entry.sources[: _inputs_of(entry)]))
        arrays = scope.reads.views(g % 2, [end - start for _, start, end in requests], pinned)
        storage.read_ranges(requests, into=[memoryview(a) for a in arrays], traffic=scope.traffic)
        out, at = [], 0
        for types in dtypes:
            raw = tuple(arrays[at : at + len(types)])
            for i, a in enumerate(raw):
                bytes_read[i] += a.size
            out.append(BlockInputs(raw, types))
            at += len(types)
        return out

    if not blocks:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="ram-dist-read") as reader:
        ahead = reader.submit(read, 0)
        for g, group in enumerate(groups):
            inputs = ahead.result()
            if g + 1 < len(groups):
                ahead = reader.submit(read, g + 1)
            scope.memory.note()
            for k, block_inputs in zip(group, inputs, strict=True):
                yield blocks[k], block_inputs


def _dequantized(
    sources: Sequence[Source],
    arrays: list[np.ndarray],
    scaled: list[int],
    floats: Callable[[int, int], np.ndarray],
) -> BlockInputs:
    """A block's inputs with each FP8 one's values dequantized to float32 (the spec's one
    multiplication per element), its bytes and scales kept beside them."""
    raw: list[np.ndarray] = list(arrays[: len(sources)])
    dtypes = [s.dtype for s in sources]
    kept: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(sources)
    for j, i in enumerate(scaled):
        scales = sources[i].scales
        assert scales is not None
        q, s_raw = arrays[i], arrays[len(sources) + j]
        values = fp8.dequantize(
            q, fp8.scale_values(s_raw, scales.dtype), scales.cols, scales.block,
            floats(i, q.size),
        )  # fmt: skip
        raw[i], dtypes[i], kept[i] = values.view(np.uint8), "F32", (q, s_raw)
    return BlockInputs(tuple(raw), tuple(dtypes), tuple(kept))


def _tensor_from_bytes(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor over the bytes (no copy); a dtype this torch build lacks is only ever
    copied, byte for byte, so it is read as bytes."""
    import torch

    from ram_dist.dtypes import SAFETENSORS_DTYPES

    data = torch.from_numpy(raw)
    return data.view(SAFETENSORS_DTYPES.get(dtype, torch.uint8))


@dataclass(frozen=True)
class Fused:
    """Whether a task's chunks may go to the method's fused kernels: kernels on for the job
    (`state["fused"]`, from `--kernels`), a CPU task (a GPU worker runs the eager rule, on
    the CPU where CUDA is absent), and numba installed. Per chunk, the inputs' dtypes (and
    the output's) must be ones the kernels handle, and the method may still decline."""

    on: bool

    @classmethod
    def of(cls, state: State, dev: str) -> Fused:
        cpu_task = dev == "cpu" and not task_gpus()
        return cls(bool(state.get("fused")) and cpu_task and kernels.available())

    def take(self, dtypes: Sequence[str], out: str | None = None) -> bool:
        return self.on and _handles(tuple(dtypes), out)


@functools.lru_cache(maxsize=256)
def _handles(dtypes: tuple[str, ...], out: str | None) -> bool:
    """`kernels.handle`, asked once per dtypes (it is asked for every block)."""
    return kernels.handle(dtypes, out)


def reduce_unit(
    unit: WorkUnit,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    round_: int,
    check_finite: bool,
    scope: TaskScope,
) -> UnitResult:
    """One reduce round: the method's statistics of the unit's active pieces, summed by key;
    with `check_finite`, also the NaN and Inf count of every input of every piece."""
    method_rounds = round_ < method.rounds

    def wanted(tensor: str) -> bool:
        active = method_rounds and method.active(round_, state, tensor)
        return layout.tensors[tensor].participating and (active or check_finite)

    pieces = tuple(p for p in unit.pieces if wanted(p.tensor))
    bytes_read = [0] * _input_count(layout)
    dev = device()
    fused = Fused.of(state, dev)
    totals: dict[str, np.ndarray] = {}
    nonfinite: dict[str, list[int]] = {}
    for block, inputs in stream_blocks(pieces, layout, storage, bytes_read, scope, dev == "cuda"):
        piece = pieces[block.piece]
        numel = layout.tensors[piece.tensor].numel
        active = method_rounds and method.active(round_, state, piece.tensor)
        chunk = Chunk(piece.tensor, piece.start + block.lo, numel)
        p = params[piece.tensor]
        stats: dict[str, np.ndarray] | None = None
        counts: list[int] | None = None
        if active and fused.take(inputs.dtypes):
            got = method.fused_statistics(
                round_, chunk, inputs.arrays(), p, state, check_finite
            )  # fmt: skip
            if got is not None:
                stats, counts = got
        if check_finite and counts is None:
            counts = _nonfinite(inputs, fused, dev)
        if counts is not None and any(counts):
            old = nonfinite.get(piece.tensor, [0] * len(counts))
            nonfinite[piece.tensor] = [a + b for a, b in zip(old, counts, strict=True)]
        if not active:
            continue
        if stats is None:
            base, *tasks = inputs.tensors(dev)
            eager = method.chunk_statistics(round_, chunk, base, tasks, p, state)
            stats = {k: v.cpu().numpy().astype(np.int64, copy=False) for k, v in eager.items()}
        _add(totals, stats)
    return UnitResult(
        unit.index, totals, None, tuple(bytes_read), peak_rss(), nonfinite or None,
        peak_private_bytes=scope.memory.note(),
    )  # fmt: skip


def _add(totals: dict[str, np.ndarray], stats: Mapping[str, np.ndarray]) -> None:
    """Add int64 statistics into `totals`, by key (sums of integers: any order)."""
    for key, value in stats.items():
        totals[key] = totals[key] + value if key in totals else np.array(value, dtype=np.int64)


def add_up(
    result: UnitResult, totals: dict[str, np.ndarray], nonfinite: dict[str, list[int]]
) -> None:
    """Add a reduce result's statistics to `totals` and its NaN/Inf counts to `nonfinite`
    (sums of integers: the order never matters)."""
    _add(totals, result.stats or {})
    for name, counts in (result.nonfinite or {}).items():
        old = nonfinite.get(name, [0] * len(counts))
        nonfinite[name] = [a + b for a, b in zip(old, counts, strict=True)]


def reduce_group(
    units: tuple[WorkUnit, ...],
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    round_: int,
    check_finite: bool,
) -> UnitResult:
    """`reduce_unit` over units one task reads together (those of one output part, so the
    map pass, which makes the part in one task, finds all their bytes in this node's input
    cache), the results summed."""
    with worker_context().task() as scope:
        results = [
            reduce_unit(u, layout, storage, method, params, state, round_, check_finite, scope)
            for u in units
        ]
        totals: dict[str, np.ndarray] = {}
        nonfinite: dict[str, list[int]] = {}
        for r in results:
            add_up(r, totals, nonfinite)
        return UnitResult(
            units[0].index,
            Statistics(totals),
            None,
            tuple(map(sum, zip(*(r.bytes_read for r in results), strict=True))),
            max(r.peak_rss_bytes for r in results),
            nonfinite or None,
            peak_private_bytes=scope.memory.note(),
            traffic=scope.traffic.total(),
            **_ran_by(),
        )


def _nonfinite(inputs: BlockInputs, fused: Fused, dev: str) -> list[int]:
    """NaN and Inf count of each input of a block: a raw-bits sweep where kernels are on."""
    from ram_dist.kernels import scan_numba

    if fused.on and all(scan_numba.supports(d) for d in inputs.dtypes):
        return [
            scan_numba.nonfinite_in(r, d) for r, d in zip(inputs.raw, inputs.dtypes, strict=True)
        ]
    import torch

    return [int((~torch.isfinite(x)).sum()) for x in inputs.tensors(dev)]


def map_unit(
    unit: WorkUnit,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    reuse_output: bool = False,
) -> UnitResult:
    """Map pass: merged bytes of a unit's pieces, in order, in each tensor's output dtype.
    With `reuse_output`, the bytes live in this process's reused output buffer (see
    `_OutputBuffer`) and are valid until the next such call."""
    with worker_context().task() as scope:
        bytes_read = [0] * _input_count(layout)
        size = unit_out_bytes(unit, layout)
        data = scope.output.take(size) if reuse_output else np.empty(size, dtype=np.uint8)
        fused_elements = _merge_into(
            unit, layout, storage, method, params, state, data, bytes_read, scope
        )  # fmt: skip
        return UnitResult(
            unit.index, None, data, tuple(bytes_read), peak_rss(),
            fused_elements=fused_elements, peak_private_bytes=scope.memory.note(),
            traffic=scope.traffic.total(),
        )  # fmt: skip


def unit_out_bytes(unit: WorkUnit, layout: Layout) -> int:
    """Bytes a unit's merged pieces take in the output shard."""
    return sum(p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces)


@dataclass(frozen=True)
class PartTask:
    """One part of an output shard to make and write: its units, in order, and the shard's
    header when it is part 1."""

    part: Part
    units: tuple[WorkUnit, ...]
    header: bytes
    target: ShardTarget


def map_part(
    task: PartTask,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
) -> UnitResult:
    """Map pass: merge a part's units into this process's reused output buffer, hash them
    (in a thread, unit by unit, while the next unit is merged) and hand the part to its
    target, which writes it in place (direct) or sends it back (through the driver)."""
    with worker_context().task() as scope:
        return _map_part(task, layout, storage, method, params, state, scope)


#: Bytes of a part made before they are handed, at once, to the thread that hashes (and
#: writes) them: each hand-off costs a thread switch and a write call, which the blocks of
#: small tensors would otherwise pay one by one.
HAND_OFF_BYTES = 1 << 20


def _map_part(
    task: PartTask,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    scope: TaskScope,
) -> UnitResult:
    part, target = task.part, task.target
    bytes_read = [0] * _input_count(layout)
    data = scope.output.take(part.size)
    at = len(task.header)
    data[:at] = np.frombuffer(task.header, dtype=np.uint8)
    digest = hashlib.sha256()
    fused_elements = 0
    scale_rows: ScaleRows = {}
    queued: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ram-dist-sha256") as behind:
        handed = [0]  # bytes of the part handed to the thread so far

        def made(hi: int, last: bool = False) -> None:
            """Bytes [0, hi) of the part are final: hash them (and write them, when the
            target streams) in the thread, in order, while the next block is merged, once at
            least `HAND_OFF_BYTES` wait (or at the `last`). A write that failed (a full disk)
            fails the part here, at a later block."""
            lo = handed[0]
            if hi - lo < HAND_OFF_BYTES and not (last and hi > lo):
                return
            while queued and queued[0].done():
                queued.pop(0).result()
            view = data[lo:hi]
            queued.append(behind.submit(digest.update, view))
            if target.streams:
                queued.append(behind.submit(target.write_at, part.start + lo, view))
            handed[0] = hi

        made(at)
        for unit in task.units:
            size = unit_out_bytes(unit, layout)
            out = data[at : at + size]
            fused_elements += _merge_into(
                unit, layout, storage, method, params, state, out, bytes_read, scope,
                on_block=lambda lo, hi, base=at: made(base + hi),
                scale_rows=scale_rows,
            )  # fmt: skip
            at += size
        made(at, last=True)
    for step in queued:
        step.result()
    if at != part.size:
        raise RuntimeError(f"{task.target.url}: part {part.number} made {at} bytes, "
                           f"expected {part.size}")  # fmt: skip
    receipt = target.write(part, data, digest.digest())
    return UnitResult(
        part.units[0] if part.units else -1, None, None, tuple(bytes_read), peak_rss(),
        fused_elements=fused_elements, peak_private_bytes=scope.memory.note(),
        receipt=receipt, traffic=scope.traffic.total(), **_ran_by(),
    )  # fmt: skip


#: New scale rows by (FP8 weight, band): a task's record of the bands it merged, so that
#: the scale tensor after its weight is written without merging the bands again.
ScaleRows = dict[tuple[str, int], np.ndarray]


def _merge_into(
    unit: WorkUnit,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    data: np.ndarray,
    bytes_read: list[int],
    scope: TaskScope,
    on_block: Callable[[int, int], None] | None = None,
    scale_rows: ScaleRows | None = None,
) -> int:
    """Merge a unit's pieces into `data` (its output bytes); returns the elements a fused
    kernel merged. `bytes_read[i]` grows by what is read from input i; `on_block(lo, hi)` is
    told, in order, of each range of `data` once it is final. `scale_rows` (kept by the
    caller across its units) holds the new scale rows of the FP8 bands merged so far; the
    bands a new scale tensor needs and no earlier piece merged are merged first, for their
    scales only."""
    dev = device()
    fused = Fused.of(state, dev)
    sizes = [p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces]
    offsets = list(itertools.accumulate(sizes, initial=0))
    address = data.ctypes.data
    rows: ScaleRows = {} if scale_rows is None else scale_rows
    stream, writes = _with_scale_bands(unit.pieces, layout, rows)
    fused_elements = 0
    blocks = stream_blocks(stream, layout, storage, bytes_read, scope, dev == "cuda")
    for block, inputs in blocks:
        piece = stream[block.piece]
        entry = layout.tensors[piece.tensor]
        written = writes[block.piece]
        width = itemsize(entry.out_dtype)
        at = offsets[written] if written is not None else 0
        lo, hi = at + block.lo * width, at + block.hi * width
        target = data[lo:hi] if written is not None else None
        if entry.scale_of is not None:
            assert target is not None
            _scales_into(entry, layout.tensors[entry.scale_of], piece, rows, target)
        elif not entry.participating:
            assert target is not None
            target[:] = inputs.raw[0]  # copied from the base, byte for byte
        else:
            chunk = Chunk(piece.tensor, piece.start + block.lo, entry.numel)
            p = params[piece.tensor]
            out_dtype = "F32" if entry.fp8_out is not None else entry.out_dtype
            merged = scope.reads.floats((-1, 0), block.hi - block.lo) if entry.fp8_out else target
            assert merged is not None
            raw = merged.view(np.uint8)
            view = _typed(raw, out_dtype, None if entry.fp8_out else address + lo)
            if (
                view is not None
                and fused.take(inputs.dtypes, out_dtype)
                and method.fused_merge(chunk, inputs.arrays(), p, state, view)
            ):
                fused_elements += block.hi - block.lo if written is not None else 0
            else:
                _merge_eager(
                    method, chunk, inputs, p, state, dev, out_dtype, raw
                )  # fmt: skip
            if entry.fp8_out is not None:
                _requantized(entry, piece.start + block.lo, merged, inputs, target, rows)
        if on_block is not None and written is not None:
            on_block(lo, hi)
    return fused_elements


def _with_scale_bands(
    pieces: tuple[Piece, ...], layout: Layout, rows: ScaleRows
) -> tuple[tuple[Piece, ...], list[int | None]]:
    """The pieces to stream: the unit's, each new scale piece preceded by the bands of its
    weight that neither `rows` nor an earlier piece holds (merged for their scales only).
    Also, per piece streamed, the index of the unit's piece it writes (None: scales only)."""
    have = set(rows)
    stream: list[Piece] = []
    writes: list[int | None] = []
    for k, piece in enumerate(pieces):
        entry = layout.tensors[piece.tensor]
        if entry.fp8_out is not None and piece.numel:
            first, last = _band_span(entry, piece.start, piece.stop)
            have.update((piece.tensor, b) for b in range(first, last))
        elif entry.scale_of is not None and piece.numel:
            weight = layout.tensors[entry.scale_of]
            assert weight.fp8_out is not None and weight.band is not None
            per = -(-weight.shape[1] // weight.fp8_out.block[1])
            missing = [
                b for b in range(piece.start // per, -(-piece.stop // per))
                if (weight.name, b) not in have
            ]  # fmt: skip
            for first, last in _runs(missing):
                stop = min(last * weight.band, weight.numel)
                stream.append(Piece(weight.name, first * weight.band, stop))
                writes.append(None)
            have.update((weight.name, b) for b in missing)
        stream.append(piece)
        writes.append(k)
    return tuple(stream), writes


def _runs(numbers: list[int]) -> list[tuple[int, int]]:
    """Increasing integers as runs [first, last) of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n:
            runs[-1] = (runs[-1][0], n + 1)
        else:
            runs.append((n, n + 1))
    return runs


def _requantized(
    entry: TensorEntry,
    start: int,
    merged: np.ndarray,
    inputs: BlockInputs,
    target: np.ndarray | None,
    rows: ScaleRows,
) -> None:
    """FP8 blocks of merged bands (elements from `start`, whole bands) into `target` (None:
    the scales only), and their new scale rows into `rows`."""
    fp8_out = entry.fp8_out
    assert fp8_out is not None and entry.band is not None
    base = inputs.fp8[0] if inputs.fp8 else None
    assert base is not None, f"{entry.name}: an FP8 output needs an FP8 base"
    cols = entry.shape[1]
    stored = fp8.requantize(
        merged, inputs.raw[0].view(np.float32), base[0], base[1], cols, fp8_out.block,
        fp8_out.scale_dtype, target,
    )  # fmt: skip
    first = start // entry.band
    per_row = stored.size // -(-merged.size // entry.band)
    for b in range(stored.size // per_row):
        rows[(entry.name, first + b)] = stored[b * per_row : (b + 1) * per_row].copy()


def _scales_into(
    entry: TensorEntry, weight: TensorEntry, piece: Piece, rows: ScaleRows, target: np.ndarray
) -> None:
    """The new scale rows of a scale piece (whole rows, one per band of its weight), taken
    out of `rows`: each is written once, so a task's record holds only rows still to write."""
    assert weight.fp8_out is not None
    per = -(-weight.shape[1] // weight.fp8_out.block[1])
    first, last = piece.start // per, -(-piece.stop // per)
    target[:] = np.concatenate([rows.pop((weight.name, b)) for b in range(first, last)])


def _merge_eager(
    method: MergeMethod,
    chunk: Chunk,
    inputs: BlockInputs,
    params: TensorParams,
    state: State,
    dev: str,
    out_dtype: str,
    target: np.ndarray,
) -> None:
    """The method's torch rule on one block, cast to the output dtype, into `target`."""
    import torch

    from ram_dist.dtypes import SAFETENSORS_DTYPES

    base, *tasks = inputs.tensors(dev)
    merged = method.merge_chunk(chunk, base, tasks, params, state)
    raw = merged.to(SAFETENSORS_DTYPES[out_dtype]).cpu().reshape(-1).view(torch.uint8)
    torch.from_numpy(target).copy_(raw)


def _typed(raw: np.ndarray, dtype: str, address: int | None = None) -> np.ndarray | None:
    """The output bytes as the array the fused kernels write for `dtype`, when they write
    that dtype and the bytes are aligned for it (`address`: where they start, when known)."""
    kind = kernels.WRITES.get(dtype)
    if kind is None:
        return None
    if (raw.ctypes.data if address is None else address) % _WIDTH[kind]:
        return None
    return raw.view(kind)


_WIDTH = {kind: np.dtype(kind).itemsize for kind in kernels.WRITES.values()}


def _blocks(numel: int, entry: TensorEntry) -> list[tuple[int, int]]:
    """Split a piece into compute blocks, so float temporaries stay small whatever the unit
    budget (the rule is element-wise: the split changes no byte). A weight with FP8 blocks
    is split at whole bands (at least one a block); new scales are one block, reading
    nothing."""
    if entry.scale_of is not None:
        return [(0, numel)] if numel else []
    step = COMPUTE_BLOCK
    if entry.band is not None:
        step = max(1, COMPUTE_BLOCK // entry.band) * entry.band
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
