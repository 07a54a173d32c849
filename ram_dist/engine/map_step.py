"""A map task: merge an output part's units into the worker's reused output buffer, in each
tensor's output dtype as raw little-endian bytes (FP8 weights requantized, with their new
scales: by the method's fused kernel in the same sweep where it writes FP8, else merged to
float32 and requantized here), hash them and hand them to the part's target. Runs on Ray
workers."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ram_dist import kernels
from ram_dist.dtypes import itemsize
from ram_dist.engine.blocks import Block, BlockInputs, BlockStream, band_span, input_count
from ram_dist.engine.memory import peak_rss
from ram_dist.engine.unit_results import UnitResult
from ram_dist.engine.worker import Fused, TaskContext, WorkScope, device, ran_by, worker_context
from ram_dist.io.sinks import ShardTarget
from ram_dist.kernels import fp8
from ram_dist.methods.protocol import Chunk, ChunkWork
from ram_dist.planning.layout import Layout, TensorEntry, unit_out_bytes
from ram_dist.planning.sources import Fp8Source
from ram_dist.planning.units import Part, Piece, WorkUnit


@dataclass(frozen=True)
class PartWork:
    """One part of an output shard to make and write: its units, in order, and the shard's
    header when it is part 1; `also`: the same part of each further output, made from the
    same reads (a sweep's other variants, `TaskContext.method.outputs`)."""

    part: Part
    units: tuple[WorkUnit, ...]
    header: bytes
    target: ShardTarget
    also: tuple[ShardTarget, ...] = ()


def map_part(work: PartWork, context: TaskContext) -> UnitResult:
    """Map pass: merge a part's units into this process's reused output buffer, hash them
    (in a thread, unit by unit, while the next unit is merged) and hand the part to its
    target, which writes it in place (direct) or sends it back (through the driver). With
    several outputs, every block read is merged once into each."""
    with worker_context().work() as scope:
        return _map_part(work, context, scope)


#: Bytes of a part made before they are handed, at once, to the thread that hashes (and
#: writes) them: each hand-off costs a thread switch and a write call, which the blocks of
#: small tensors would otherwise pay one by one.
HAND_OFF_BYTES = 1 << 20


class _ParamsOf(Mapping[str, Any]):
    """One output's parameters of every tensor, taken from a method of several outputs
    (`output_params`) as they are asked for."""

    def __init__(self, params: Mapping[str, Any], method: Any, k: int) -> None:
        self._params, self._method, self._k = params, method, k

    def __getitem__(self, name: str) -> Any:
        return self._method.output_params(self._params[name], self._k)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def output_contexts(context: TaskContext) -> list[TaskContext]:
    """The context of each output a map task makes: the pass's own, or, for a method that
    makes several (`outputs`), one per output with that output's method, state and
    parameters."""
    outputs = getattr(context.method, "outputs", None)
    if outputs is None:
        return [context]
    return [
        replace(context, method=m, state=s, params=_ParamsOf(context.params, context.method, k))
        for k, (m, s) in enumerate(outputs(context.state))
    ]


class _Output:
    """One output of a map task: its bytes, their digest, and what was handed on so far."""

    def __init__(self, target: ShardTarget, data: np.ndarray, part: Part) -> None:
        self.target, self.data, self.part = target, data, part
        self.digest = hashlib.sha256()
        self.handed = 0


def _map_part(work: PartWork, context: TaskContext, scope: WorkScope) -> UnitResult:
    part = work.part
    scope.kept = context.flags.kept
    layout = context.layout
    bytes_read = [0] * input_count(layout)
    contexts = output_contexts(context)
    targets = (work.target, *work.also)
    if len(targets) != len(contexts):
        raise RuntimeError(f"{len(targets)} targets for {len(contexts)} outputs")
    outputs = [_Output(t, scope.output.take(part.size, k), part) for k, t in enumerate(targets)]
    makings = [_Making(c, scope, bytes_read) for c in contexts]
    at = len(work.header)
    for o in outputs:
        o.data[:at] = np.frombuffer(work.header, dtype=np.uint8)
    fused_elements = 0
    clock = scope.clock
    with _Behind() as behind:
        queued = behind.queued

        def made(k: int, hi: int, last: bool = False) -> None:
            """Bytes [0, hi) of output k's part are final: hash them (and write them, when
            the target streams) in the thread, in order, while the next block is merged,
            once at least `HAND_OFF_BYTES` wait (or at the `last`). A write that failed (a
            full disk) fails the part here, at a later block."""
            o = outputs[k]
            lo = o.handed
            if hi - lo < HAND_OFF_BYTES and not (last and hi > lo):
                return
            while queued and queued[0].done():
                queued.pop(0).result()
            view = o.data[lo:hi]
            behind.run(hash_of, o, view, last=last)
            if o.target.streams:
                behind.run(write_at, o, part.start + lo, view, last=last)
            o.handed = hi

        def hash_of(o: _Output, view: np.ndarray) -> None:
            with clock.timing("hash_s"):
                o.digest.update(view)

        def write_at(o: _Output, offset: int, view: np.ndarray) -> None:
            with clock.timing("write_s"):
                o.target.write_at(offset, view)

        for k in range(len(outputs)):
            made(k, at)
        for unit in work.units:
            size = unit_out_bytes(unit, layout)
            outs = [o.data[at : at + size] for o in outputs]
            fused_elements += _merge_into(
                unit, makings, outs, on_block=lambda k, lo, hi, base=at: made(k, base + hi)
            )
            at += size
        with clock.timing("write_wait_s"):  # a part's last hand-off may run right here
            for k in range(len(outputs)):
                made(k, at, last=True)
            for step in queued:
                step.result()
    if at != part.size:
        raise RuntimeError(f"{work.target.url}: part {part.number} made {at} bytes, "
                           f"expected {part.size}")  # fmt: skip
    receipts = []
    for o in outputs:
        with clock.timing("write_wait_s"), clock.timing("write_s"):
            receipts.append(o.target.write(part, o.data, o.digest.digest()))
    return UnitResult(
        part.units[0] if part.units else -1, None, None, tuple(bytes_read), peak_rss(),
        fused_elements=fused_elements, peak_private_bytes=scope.memory.note(),
        receipt=receipts[0], receipts=tuple(receipts[1:]), traffic=scope.traffic.total(),
        times=clock.times(len(work.units)), lora_formed=scope.products.formed,
        lora_reused=scope.products.reused, **ran_by(),
    )  # fmt: skip


class _Behind:
    """The thread that hashes (and writes) a part's bytes behind the merging, in order,
    started at the first hand-off that leaves merging to overlap. A hand-off at the part's
    end with no thread started yet (a part under `HAND_OFF_BYTES`: all of a small model's)
    runs in the computing thread, as it would wait for the thread anyway: starting and
    joining one per task costs more than hashing its bytes. Queued work is finished before
    the block ends, whatever ends it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.queued: list[Future[None]] = []

    def run(self, fn: Callable[..., None], *args: Any, last: bool) -> None:
        if last and self._pool is None:
            fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ram-dist-sha256")
        self.queued.append(self._pool.submit(fn, *args))

    def __enter__(self) -> _Behind:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


#: New scale rows by (FP8 weight, band): a task's record of the bands it merged, so that
#: the scale tensor after its weight is written without merging the bands again.
ScaleRows = dict[tuple[str, int], np.ndarray]


@dataclass
class _Making:
    """What the units of one part share while they are merged into one output: the output's
    context, the task's scope, the bytes read from each input so far (one list for every
    output: they share the reads), and the new scale rows of the FP8 bands merged so far
    (`ScaleRows`)."""

    context: TaskContext
    scope: WorkScope
    bytes_read: list[int]
    scale_rows: ScaleRows = field(default_factory=dict)
    fused: Fused = Fused(False)
    """Whether the task's blocks may go to the fused kernels (`_merge_into` sets it)."""
    device: str = "cpu"
    """Where the task computes (`_merge_into` sets it)."""


def _merge_into(
    unit: WorkUnit,
    makings: list[_Making],
    outs: list[np.ndarray],
    on_block: Callable[[int, int, int], None] | None = None,
) -> int:
    """Merge a unit's pieces into `outs[k]` (its output bytes, one per output) from blocks
    read once; returns the elements a fused kernel merged (into the first output).
    `bytes_read[i]` grows by what is read from input i; `on_block(k, lo, hi)` is told, in
    order, of each range of `outs[k]` once it is final. Each making's `scale_rows` (kept
    across the part's units) holds the new scale rows of the FP8 bands merged so far; the
    bands a new scale tensor needs and no earlier piece merged are merged first, for their
    scales only."""
    first = makings[0]
    layout = first.context.layout
    dev = device()
    fused = Fused.of(first.context.flags, dev)
    for making in makings:
        making.fused, making.device = fused, dev
    sizes = [p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces]
    offsets = list(itertools.accumulate(sizes, initial=0))
    stream, writes = _with_scale_bands(unit.pieces, layout, first.scale_rows)
    fused_elements = 0
    blocks = BlockStream(
        stream, layout, first.context.storage, first.bytes_read, first.scope, dev == "cuda"
    )  # fmt: skip
    for block, inputs in blocks:
        piece = stream[block.piece]
        entry = layout.tensors[piece.tensor]
        written = writes[block.piece]
        width = itemsize(entry.out_dtype)
        at = offsets[written] if written is not None else 0
        lo, hi = at + block.lo * width, at + block.hi * width
        for k, (making, data) in enumerate(zip(makings, outs, strict=True)):
            target = data[lo:hi] if written is not None else None
            got = _merge_block(making, block, piece, inputs, target)
            if k == 0 and written is not None:
                fused_elements += got
            if on_block is not None and written is not None:
                on_block(k, lo, hi)
    return fused_elements


def _merge_block(
    making: _Making,
    block: Block,
    piece: Piece,
    inputs: BlockInputs,
    target: np.ndarray | None,
) -> int:
    """One block of one piece into one output's `target` (None: the scales only, of an FP8
    band); returns the elements a fused kernel merged."""
    context, scope, rows = making.context, making.scope, making.scale_rows
    method, params, state, flags = context.method, context.params, context.state, context.flags
    entry = context.layout.tensors[piece.tensor]
    fused, dev = making.fused, making.device
    if entry.scale_of is not None:
        assert target is not None
        _scales_into(entry, context.layout.tensors[entry.scale_of], piece, rows, target)
        return 0
    if not entry.participating:
        assert target is not None
        target[:] = inputs.raw[0]  # copied from the base, byte for byte
        return 0
    n = block.hi - block.lo
    chunk = Chunk(piece.tensor, piece.start + block.lo, entry.shape)
    p = params[piece.tensor]
    out_dtype = entry.merged_dtype
    if _fused_fp8(making, chunk, inputs, fused, entry, target):
        return n
    encoded = bool(getattr(method, "reads_stored", False))  # quantized inputs read as stored
    merged = scope.reads.floats((-1, 0), n) if entry.fp8_out else target
    assert merged is not None
    raw = merged.view(np.uint8)
    view = _typed(raw, out_dtype, None if entry.fp8_out or target is None else target.ctypes.data)
    got = 0
    if (
        view is not None
        and fused.take(inputs.dtypes, out_dtype)
        and method.fused_merge(
            ChunkWork(chunk, p, state, bf16_nan=flags.bf16_nan), inputs.arrays(encoded), view
        )
    ):
        got = n
    else:
        _merge_eager(context, chunk, inputs, dev, out_dtype, raw)
    if entry.fp8_out is not None:
        _requantized(making, entry, piece.start + block.lo, merged, inputs, target)
    return got


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
            first, last = band_span(entry, piece.start, piece.stop)
            have.update((piece.tensor, b) for b in range(first, last))
        elif entry.scale_of is not None and piece.numel:
            weight = layout.tensors[entry.scale_of]
            assert weight.fp8_out is not None and weight.band is not None
            per = weight.fp8_out.per_band
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


def _fused_fp8(
    making: _Making,
    chunk: Chunk,
    inputs: BlockInputs,
    fused: Fused,
    entry: TensorEntry,
    target: np.ndarray | None,
) -> bool:
    """An FP8 output's bands merged and written as FP8 by the method's fused kernel in one
    sweep (`writes_fp8`: it reads the inputs as stored, no float32 copy of any, and writes
    the blocks and their scales), into `target` (None: the scales only) and the part's scale
    rows; False where it does not (then the engine merges to float32 and requantizes)."""
    context, rows = making.context, making.scale_rows
    method, params, state = context.method, context.params[chunk.tensor], context.state
    fp8_out = entry.fp8_out
    if (
        fp8_out is None
        or not getattr(method, "writes_fp8", False)
        or not inputs.encoded
        or not isinstance(inputs.encoded[0], fp8.Fp8Values)
        or not fused.take(inputs.dtypes, entry.merged_dtype)
    ):
        return False
    base_scales = inputs.stored[0][1]  # type: ignore[index]
    out = fp8.Fp8Target(
        np.empty(0, np.uint8) if target is None else target, fp8_out.scale_dtype, base_scales,
        np.empty_like(base_scales),
    )  # fmt: skip
    if not method.fused_merge(ChunkWork(chunk, params, state), inputs.arrays(True), out):
        return False
    _keep_scale_rows(entry, chunk.start, inputs.encoded[0].size, out.scales, rows)  # type: ignore[union-attr]
    return True


def _requantized(
    making: _Making,
    entry: TensorEntry,
    start: int,
    merged: np.ndarray,
    inputs: BlockInputs,
    target: np.ndarray | None,
) -> None:
    """FP8 blocks of merged bands (elements from `start`, whole bands) into `target` (None:
    the scales only), and their new scale rows into the map step's scale rows; the base's
    values of a few bands at a time go in a reusable float32 scratch of the step's reads."""
    fp8_out = entry.fp8_out
    assert fp8_out is not None and entry.band is not None
    base = inputs.stored[0] if inputs.stored else None
    assert base is not None, f"{entry.name}: an FP8 output needs an FP8 base"
    src = entry.sources[0]
    assert isinstance(src, Fp8Source)
    # the base's values made from its stored bytes a few bands at a time: no float32 copy
    # of them for the block (the method's kernels read it as stored)
    stored = fp8.requantize_stored(
        merged, base[0], base[1], fp8_out.cols, fp8_out.block, fp8_out.scale_dtype,
        src.rounded_to, target,
        making.scope.reads.floats((-1, 1), min(merged.size, max(fp8.BAND_GROUP, entry.band))),
    )  # fmt: skip
    _keep_scale_rows(entry, start, merged.size, stored, making.scale_rows)


def _keep_scale_rows(
    entry: TensorEntry, start: int, numel: int, stored: np.ndarray, rows: ScaleRows
) -> None:
    """The new scale rows (`stored`, bytes) of `numel` elements of whole bands from `start`
    into `rows`, one per band."""
    assert entry.band is not None
    first = start // entry.band
    per_row = stored.size // -(-numel // entry.band)
    for b in range(stored.size // per_row):
        rows[(entry.name, first + b)] = stored[b * per_row : (b + 1) * per_row].copy()


def _scales_into(
    entry: TensorEntry, weight: TensorEntry, piece: Piece, rows: ScaleRows, target: np.ndarray
) -> None:
    """The new scale rows of a scale piece (whole rows, one per band of its weight), taken
    out of `rows`: each is written once, so a task's record holds only rows still to write."""
    assert weight.fp8_out is not None
    per = weight.fp8_out.per_band
    first, last = piece.start // per, -(-piece.stop // per)
    target[:] = np.concatenate([rows.pop((weight.name, b)) for b in range(first, last)])


def _merge_eager(
    context: TaskContext,
    chunk: Chunk,
    inputs: BlockInputs,
    dev: str,
    out_dtype: str,
    target: np.ndarray,
) -> None:
    """The method's torch rule on one block, cast to the output dtype, into `target`."""
    method, params, state = context.method, context.params[chunk.tensor], context.state
    import torch

    from ram_dist.dtypes import SAFETENSORS_DTYPES

    base, *tasks = inputs.tensors(dev)
    merged = method.merge_chunk(ChunkWork(chunk, params, state), base, tasks)
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
