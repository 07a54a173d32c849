"""What a worker does with one work unit. Runs on Ray workers (or inline in tests).

A unit's pieces are read as byte ranges of every input it needs, turned into tensors without
parsing anything else, handed to the merge method, and (map pass) cast to the output dtype
and returned as raw little-endian bytes, ready to append to the output shard.
"""

from __future__ import annotations

import resource
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ram_dist import kernels
from ram_dist.dtypes import SAFETENSORS_DTYPES, itemsize
from ram_dist.engine.layout import Layout, TensorEntry
from ram_dist.io.storage import Storage
from ram_dist.methods import MergeMethod
from ram_dist.methods.registry import Chunk, State, TensorParams
from ram_dist.plan import WorkUnit

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


def device() -> torch.device:
    """The GPU when this worker was given one, else the CPU: the bytes are the same."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _inputs_of(entry: TensorEntry) -> int:
    return len(entry.sources) if entry.participating else 1


def read_unit(
    unit: WorkUnit, layout: Layout, storage: Storage
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Read every piece of a unit from every input it needs: one batched range read."""
    requests: list[tuple[str, int, int]] = []
    owners: list[tuple[int, int, str]] = []
    for p, piece in enumerate(unit.pieces):
        entry = layout.tensors[piece.tensor]
        for i, src in enumerate(entry.sources[: _inputs_of(entry)]):
            size = itemsize(src.dtype)
            requests.append(
                (src.file, src.start + piece.start * size, src.start + piece.stop * size)
            )
            owners.append((p, i, src.dtype))
    n_inputs = max(len(e.sources) for e in layout.tensors.values())
    bytes_read = [0] * n_inputs
    tensors: list[list[torch.Tensor]] = [[] for _ in unit.pieces]
    for blob, (p, i, dtype) in zip(storage.read_ranges(requests), owners, strict=True):
        bytes_read[i] += len(blob)
        tensors[p].append(_tensor_from_bytes(blob, dtype))
    return tensors, bytes_read


def _tensor_from_bytes(blob: bytes, dtype: str) -> torch.Tensor:
    if not blob:
        return torch.empty(0, dtype=SAFETENSORS_DTYPES[dtype])
    with warnings.catch_warnings():
        # The buffer is read-only bytes; nothing here writes to it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(blob, dtype=SAFETENSORS_DTYPES[dtype])


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
    tensors, bytes_read = read_unit(WorkUnit(unit.index, unit.shard, pieces), layout, storage)
    dev = device()
    totals: dict[str, torch.Tensor] = {}
    nonfinite: dict[str, list[int]] = {}
    for piece, inputs in zip(pieces, tensors, strict=True):
        numel = layout.tensors[piece.tensor].numel
        active = method_rounds and method.active(round_, state, piece.tensor)
        for lo, hi in _blocks(piece.numel):
            base, *tasks = (t[lo:hi].to(dev) for t in inputs)
            chunk = Chunk(piece.tensor, piece.start + lo, numel)
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
                stats = method.chunk_statistics(
                    round_, chunk, base, tasks, params[piece.tensor], state
                )
            for key, value in stats.items():
                value = value.to(device="cpu", dtype=torch.int64)
                totals[key] = totals[key] + value if key in totals else value
    return UnitResult(unit.index, totals, None, tuple(bytes_read), _peak_rss(), nonfinite or None)


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
) -> UnitResult:
    """Map pass: merged bytes of a unit's pieces, in order, in each tensor's output dtype."""
    tensors, bytes_read = read_unit(unit, layout, storage)
    dev = device()
    sizes = [p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces]
    data = np.empty(sum(sizes), dtype=np.uint8)
    out = torch.from_numpy(data)
    offset = fused_elements = 0
    for piece, inputs, size in zip(unit.pieces, tensors, sizes, strict=True):
        entry = layout.tensors[piece.tensor]
        target = out[offset : offset + size]
        offset += size
        if not entry.participating:
            target.copy_(inputs[0].view(torch.uint8))  # copied from the base, byte for byte
            continue
        out_dtype = SAFETENSORS_DTYPES[entry.out_dtype]
        width = itemsize(entry.out_dtype)
        for lo, hi in _blocks(piece.numel):
            base, *tasks = (t[lo:hi].to(dev) for t in inputs)
            chunk = Chunk(piece.tensor, piece.start + lo, entry.numel)
            fused = getattr(method, "merge_into", None)
            view = _typed(target[lo * width : hi * width], out_dtype)
            if (
                fused
                and view is not None
                and fused(chunk, base, tasks, params[piece.tensor], state, view)
            ):
                fused_elements += hi - lo
                continue
            merged = method.merge_chunk(chunk, base, tasks, params[piece.tensor], state)
            target[lo * width : hi * width].copy_(merged.to(out_dtype).cpu().view(torch.uint8))
    return UnitResult(
        unit.index, None, data, tuple(bytes_read), _peak_rss(), fused_elements=fused_elements
    )


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


def _peak_rss() -> int:
    """This worker process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
