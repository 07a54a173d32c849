"""What a worker does with one work unit. Runs on Ray workers (or inline in tests).

A unit's pieces are read as byte ranges of every input it needs, turned into tensors without
parsing anything else, handed to the merge method, and (map pass) cast to the output dtype
and returned as raw little-endian bytes, ready to append to the output shard.
"""

from __future__ import annotations

import hashlib
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from ram_dist import kernels
from ram_dist.dtypes import SAFETENSORS_DTYPES, itemsize
from ram_dist.engine import memory
from ram_dist.engine.layout import Layout, TensorEntry
from ram_dist.io.sinks import PartReceipt, ShardTarget
from ram_dist.io.storage import Buffer, Storage
from ram_dist.methods import MergeMethod
from ram_dist.methods.registry import Chunk, State, TensorParams
from ram_dist.plan import Part, Piece, WorkUnit

#: Elements computed at once; bounds a worker's float temporaries (about 40 bytes each).
COMPUTE_BLOCK = 1 << 22


@dataclass(frozen=True)
class UnitResult:
    """What a unit sends back: statistics or output bytes, plus what it cost."""

    index: int
    stats: dict[str, torch.Tensor] | None
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


def task_gpus() -> tuple[str, ...] | None:
    """The GPU ids Ray gave the running task (empty when it gave none); None outside a Ray
    worker process (the driver, or a test calling the work inline)."""
    if not ray.is_initialized():
        return None
    if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return tuple(str(g) for g in ray.get_gpu_ids())


def device() -> torch.device:
    """The GPU when this task was given one, else the CPU: the bytes are the same. A Ray
    task given no GPU computes on the CPU, with the fused kernels, even where CUDA is
    visible (Ray leaves CUDA_VISIBLE_DEVICES alone for it: `--device cpu` on a GPU node);
    outside Ray, the GPU whenever CUDA is available."""
    if task_gpus() == ():
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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
    return len(entry.sources) if entry.participating else 1


def read_unit(
    unit: WorkUnit, layout: Layout, storage: Storage
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Read every piece of a unit from every input it needs, at once (one batched read)."""
    requests: list[tuple[str, int, int]] = []
    owners: list[tuple[int, int, str]] = []
    for p, piece in enumerate(unit.pieces):
        entry = layout.tensors[piece.tensor]
        ranges = _ranges(entry, piece.start, piece.stop)
        requests += ranges
        owners += [(p, i, src.dtype) for i, src in enumerate(entry.sources[: len(ranges)])]
    bytes_read = [0] * _input_count(layout)
    tensors: list[list[torch.Tensor]] = [[] for _ in unit.pieces]
    for blob, (p, i, dtype) in zip(storage.read_ranges(requests), owners, strict=True):
        bytes_read[i] += len(blob)
        tensors[p].append(_tensor_from_bytes(blob, dtype))
    return tensors, bytes_read


def _ranges(entry: TensorEntry, start: int, stop: int) -> list[tuple[str, int, int]]:
    """The byte ranges of elements [start, stop) of a tensor in every input it needs (base
    first; only the base for a tensor that is copied)."""
    out = []
    for src in entry.sources[: _inputs_of(entry)]:
        size = itemsize(src.dtype)
        out.append((src.file, src.start + start * size, src.start + stop * size))
    return out


def _input_count(layout: Layout) -> int:
    return max(len(e.sources) for e in layout.tensors.values())


@dataclass(frozen=True)
class Block:
    """Elements [lo, hi) of one piece of a unit: what is read and computed at once."""

    piece: int
    lo: int
    hi: int


class _Buffers:
    """Two reusable read buffers per worker process (the block being computed and the one
    being read): fresh memory would be faulted in, and zeroed by the kernel, for every block,
    which costs as much as the copy out of the page cache. On a GPU worker they are pinned,
    so that copies to the device can run asynchronously."""

    ALIGN = 64

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2

    def views(self, slot: int, sizes: list[int]) -> list[memoryview]:
        offsets, total = [], 0
        for size in sizes:
            offsets.append(total)
            total += -(-size // self.ALIGN) * self.ALIGN
        if self._slots[slot].numel() < total:
            pinned = device().type == "cuda"  # never a CUDA context in a CPU task
            self._slots[slot] = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        whole = memoryview(self._slots[slot].numpy())
        return [whole[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


_BUFFERS = _Buffers()


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
            self._data = np.empty(size, dtype=np.uint8)
        return self._data[:size]


_OUTPUT = _OutputBuffer()


def stream_blocks(
    pieces: tuple[Piece, ...], layout: Layout, storage: Storage, bytes_read: list[int]
) -> Iterator[tuple[Block, list[torch.Tensor]]]:
    """Each compute block of `pieces` with its inputs (base first; only the base for tensors
    that are copied), in order. A thread reads the next block while the caller computes this
    one (reads and the fused kernels release the GIL), into one of two reused buffers: the
    tensors of a block are valid until the caller asks for the block after it.
    `bytes_read[i]` grows by what is read from input i."""
    blocks = [Block(p, lo, hi) for p, piece in enumerate(pieces) for lo, hi in _blocks(piece.numel)]

    def read(k: int) -> list[torch.Tensor]:
        block = blocks[k]
        piece = pieces[block.piece]
        entry = layout.tensors[piece.tensor]
        sources = entry.sources[: _inputs_of(entry)]
        requests = _ranges(entry, piece.start + block.lo, piece.start + block.hi)
        views = _BUFFERS.views(k % 2, [end - start for _, start, end in requests])
        blobs = storage.read_ranges(requests, into=views)
        for i, blob in enumerate(blobs):
            bytes_read[i] += len(blob)
        return [_tensor_from_bytes(b, s.dtype) for b, s in zip(blobs, sources, strict=True)]

    if not blocks:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="ram-dist-read") as reader:
        ahead = reader.submit(read, 0)
        for k, block in enumerate(blocks):
            inputs = ahead.result()
            if k + 1 < len(blocks):
                ahead = reader.submit(read, k + 1)
            memory.note()
            yield block, inputs


def _tensor_from_bytes(blob: Buffer, dtype: str) -> torch.Tensor:
    if not len(blob):
        return torch.empty(0, dtype=SAFETENSORS_DTYPES.get(dtype, torch.uint8))
    with warnings.catch_warnings():
        # Fetched bytes are read-only; nothing here writes to them.
        warnings.simplefilter("ignore", UserWarning)
        # A dtype this torch build lacks is only ever copied, byte for byte: read it as bytes.
        return torch.frombuffer(blob, dtype=SAFETENSORS_DTYPES.get(dtype, torch.uint8))


def reduce_unit(
    unit: WorkUnit,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    round_: int,
    check_finite: bool,
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
    totals: dict[str, torch.Tensor] = {}
    nonfinite: dict[str, list[int]] = {}
    for block, inputs in stream_blocks(pieces, layout, storage, bytes_read):
        piece = pieces[block.piece]
        numel = layout.tensors[piece.tensor].numel
        active = method_rounds and method.active(round_, state, piece.tensor)
        base, *tasks = (t.to(dev, non_blocking=True) for t in inputs)
        chunk = Chunk(piece.tensor, piece.start + block.lo, numel)
        stats, counts = None, None
        if active and check_finite:  # one sweep for both, when the method has one
            both = _checked_statistics(method, round_, chunk, base, tasks, params, state)
            stats, counts = both if both is not None else (None, None)
        if check_finite and counts is None:
            counts = [_nonfinite(x, state) for x in (base, *tasks)]
        if counts is not None and any(counts):
            old = nonfinite.get(piece.tensor, [0] * len(counts))
            nonfinite[piece.tensor] = [a + b for a, b in zip(old, counts, strict=True)]
        if not active:
            continue
        if stats is None:
            stats = method.chunk_statistics(round_, chunk, base, tasks, params[piece.tensor], state)
        for key, value in stats.items():
            value = value.to(device="cpu", dtype=torch.int64)
            totals[key] = totals[key] + value if key in totals else value
    return UnitResult(
        unit.index, totals, None, tuple(bytes_read), memory.peak_rss(), nonfinite or None,
        peak_private_bytes=memory.note(),
    )  # fmt: skip


def add_up(
    result: UnitResult, totals: dict[str, torch.Tensor], nonfinite: dict[str, list[int]]
) -> None:
    """Add a reduce result's statistics to `totals` and its NaN/Inf counts to `nonfinite`
    (sums of integers: the order never matters)."""
    for key, value in (result.stats or {}).items():
        totals[key] = totals[key] + value if key in totals else value
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
    results = [
        reduce_unit(u, layout, storage, method, params, state, round_, check_finite) for u in units
    ]
    totals: dict[str, torch.Tensor] = {}
    nonfinite: dict[str, list[int]] = {}
    for r in results:
        add_up(r, totals, nonfinite)
    return UnitResult(
        units[0].index,
        totals,
        None,
        tuple(map(sum, zip(*(r.bytes_read for r in results), strict=True))),
        max(r.peak_rss_bytes for r in results),
        nonfinite or None,
        peak_private_bytes=max(r.peak_private_bytes for r in results),
        **_ran_by(),
    )


def _checked_statistics(
    method: MergeMethod,
    round_: int,
    chunk: Chunk,
    base: torch.Tensor,
    tasks: list[torch.Tensor],
    params: Mapping[str, TensorParams],
    state: State,
) -> tuple[dict[str, torch.Tensor], list[int]] | None:
    """The method's statistics and the inputs' NaN/Inf counts from one fused sweep, when the
    method offers one for this chunk (`chunk_statistics_checked`); else None."""
    fused = getattr(method, "chunk_statistics_checked", None)
    if fused is None:
        return None
    return fused(round_, chunk, base, tasks, params[chunk.tensor], state)


def _nonfinite(x: torch.Tensor, state: State) -> int:
    """NaN and Inf count of one input block: a raw-bits sweep when kernels are on."""
    if state.get("fused") and x.device.type == "cpu" and kernels.available():
        from ram_dist.kernels import scan_numba

        if scan_numba.supports(x.dtype):
            return scan_numba.nonfinite_count(x)
    return int((~torch.isfinite(x)).sum())


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
    bytes_read = [0] * _input_count(layout)
    size = unit_out_bytes(unit, layout)
    data = _OUTPUT.take(size) if reuse_output else np.empty(size, dtype=np.uint8)
    fused_elements = _merge_into(unit, layout, storage, method, params, state, data, bytes_read)
    return UnitResult(
        unit.index, None, data, tuple(bytes_read), memory.peak_rss(),
        fused_elements=fused_elements, peak_private_bytes=memory.note(),
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
    part, target = task.part, task.target
    bytes_read = [0] * _input_count(layout)
    data = _OUTPUT.take(part.size)
    at = len(task.header)
    data[:at] = np.frombuffer(task.header, dtype=np.uint8)
    digest = hashlib.sha256()
    fused_elements = 0
    queued: list[Future[None]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="ram-dist-sha256") as behind:

        def made(lo: int, hi: int) -> None:
            """Bytes [lo, hi) of the part are final: hash them (and write them, when the
            target streams) in the thread, in order, while the next block is merged. A write
            that failed (a full disk) fails the part here, at the next block."""
            while queued and queued[0].done():
                queued.pop(0).result()
            view = data[lo:hi]
            queued.append(behind.submit(digest.update, view))
            if target.streams:
                queued.append(behind.submit(target.write_at, part.start + lo, view))

        made(0, at)
        for unit in task.units:
            size = unit_out_bytes(unit, layout)
            out = data[at : at + size]
            fused_elements += _merge_into(
                unit, layout, storage, method, params, state, out, bytes_read,
                on_block=lambda lo, hi, base=at: made(base + lo, base + hi),
            )  # fmt: skip
            at += size
    for step in queued:
        step.result()
    if at != part.size:
        raise RuntimeError(f"{task.target.url}: part {part.number} made {at} bytes, "
                           f"expected {part.size}")  # fmt: skip
    receipt = target.write(part, data, digest.digest())
    return UnitResult(
        part.units[0] if part.units else -1, None, None, tuple(bytes_read), memory.peak_rss(),
        fused_elements=fused_elements, peak_private_bytes=memory.note(), receipt=receipt,
        **_ran_by(),
    )  # fmt: skip


def _merge_into(
    unit: WorkUnit,
    layout: Layout,
    storage: Storage,
    method: MergeMethod,
    params: Mapping[str, TensorParams],
    state: State,
    data: np.ndarray,
    bytes_read: list[int],
    on_block: Callable[[int, int], None] | None = None,
) -> int:
    """Merge a unit's pieces into `data` (its output bytes); returns the elements a fused
    kernel merged. `bytes_read[i]` grows by what is read from input i; `on_block(lo, hi)` is
    told, in order, of each range of `data` once it is final."""
    dev = device()
    sizes = [p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    out = torch.from_numpy(data)
    fused_elements = 0
    fused = getattr(method, "merge_into", None)
    for block, inputs in stream_blocks(unit.pieces, layout, storage, bytes_read):
        piece = unit.pieces[block.piece]
        entry = layout.tensors[piece.tensor]
        width = itemsize(entry.out_dtype)
        at = offsets[block.piece]
        target = out[at + block.lo * width : at + block.hi * width]
        lo, hi = at + block.lo * width, at + block.hi * width
        if not entry.participating:
            target.copy_(inputs[0].view(torch.uint8))  # copied from the base, byte for byte
        else:
            base, *tasks = (t.to(dev, non_blocking=True) for t in inputs)
            chunk = Chunk(piece.tensor, piece.start + block.lo, entry.numel)
            view = _typed(target, SAFETENSORS_DTYPES[entry.out_dtype])
            p = params[piece.tensor]
            if fused and view is not None and fused(chunk, base, tasks, p, state, view):
                fused_elements += block.hi - block.lo
            else:
                merged = method.merge_chunk(chunk, base, tasks, p, state)
                out_dtype = SAFETENSORS_DTYPES[entry.out_dtype]
                target.copy_(merged.to(out_dtype).cpu().view(torch.uint8))
        if on_block is not None:
            on_block(lo, hi)
    return fused_elements


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The output bytes seen as `dtype`, when their alignment allows it."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return None


def _blocks(numel: int) -> list[tuple[int, int]]:
    """Split a piece into compute blocks, so float temporaries stay small whatever the chunk
    budget (the rule is element-wise: the split changes no byte)."""
    return [(lo, min(lo + COMPUTE_BLOCK, numel)) for lo in range(0, numel, COMPUTE_BLOCK)]
