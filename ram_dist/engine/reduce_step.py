"""A reduce task: the method's int64 statistics of a unit's chunks (fused kernels or the
eager rule), and the NaN/Inf count of every input in the check round. Runs on Ray workers."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from ram_dist.dtypes import INFO
from ram_dist.engine.blocks import BlockInputs, BlockStream, input_count, tensor_from_bytes
from ram_dist.engine.memory import peak_rss
from ram_dist.engine.unit_results import PrecisionCounts, Statistics, UnitResult
from ram_dist.engine.worker import Fused, TaskContext, WorkScope, device, ran_by, worker_context
from ram_dist.kernels import precision, stored_nonfinite
from ram_dist.methods import MergeMethod
from ram_dist.methods.parameters import EPSILON
from ram_dist.methods.protocol import Chunk, ChunkWork, TensorParams
from ram_dist.planning.units import WorkUnit


def reduce_unit(
    unit: WorkUnit, context: TaskContext, round_: int, check_finite: bool, scope: WorkScope
) -> UnitResult:
    """One reduce round: the method's statistics of the unit's active pieces, summed by key;
    with `check_finite`, also the NaN and Inf count of every input of every piece."""
    layout, method, params, state = context.layout, context.method, context.params, context.state
    method_rounds = round_ < method.rounds

    def wanted(tensor: str) -> bool:
        active = method_rounds and method.active(round_, state, tensor)
        return layout.tensors[tensor].participating and (active or check_finite)

    pieces = tuple(p for p in unit.pieces if wanted(p.tensor))
    scope.kept = context.flags.kept
    bytes_read = [0] * input_count(layout)
    dev = device()
    fused = Fused.of(context.flags, dev)
    encoded = bool(getattr(method, "reads_stored", False))  # quantized inputs read as stored
    totals: dict[str, np.ndarray] = {}
    nonfinite: dict[str, list[int]] = {}
    checked = PrecisionCounts.zeros(input_count(layout) - 1) if check_finite else None
    blocks = BlockStream(pieces, layout, context.storage, bytes_read, scope, dev == "cuda")
    for block, inputs in blocks:
        piece = pieces[block.piece]
        entry = layout.tensors[piece.tensor]
        active = method_rounds and method.active(round_, state, piece.tensor)
        chunk = Chunk(piece.tensor, piece.start + block.lo, entry.shape)
        p = params[piece.tensor]
        work = ChunkWork(chunk, p, state, round_, check_finite)
        stats: dict[str, np.ndarray] | None = None
        counts: list[int] | None = None
        swept: np.ndarray | None = None  # the precision check, from the method's sweep
        if active and fused.take(inputs.dtypes):
            got = method.fused_statistics(work, inputs.arrays(encoded))
            if got is not None:
                stats, counts, swept = (*got, None)[:3]
        if check_finite and counts is None:
            counts = _nonfinite(inputs, fused, dev)
        if counts is not None and any(counts):
            old = nonfinite.get(piece.tensor, [0] * len(counts))
            nonfinite[piece.tensor] = [a + b for a, b in zip(old, counts, strict=True)]
        if checked is not None and _needs_check(tuple(s.values_dtype for s in entry.sources)):
            checked.add(piece.tensor, _check_counts(inputs, fused, p, swept))
        if not active:
            continue
        if stats is None:
            base, *tasks = inputs.tensors(dev)
            eager = method.chunk_statistics(work, base, tasks)
            stats = {k: v.cpu().numpy() for k, v in eager.items()}
        _add(totals, integers(method, stats))
    return UnitResult(
        unit.index, totals, None, tuple(bytes_read), peak_rss(), nonfinite or None,
        peak_private_bytes=scope.memory.note(), precision=checked,
    )  # fmt: skip


def integers(method: MergeMethod, stats: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`stats` as int64, or an error naming the method and the statistic that is not made of
    integers: float totals would depend on how units cut the tensor and on the order they
    finish in. A float sum a method needs is an exact sum (`methods.exact_sums`)."""
    out = {}
    for key, value in stats.items():
        if value.dtype.kind not in "iub":
            raise TypeError(
                f"merge method {method.name}: reduce statistic {key!r} is {value.dtype}, not "
                "integers; sum floats exactly with ram_dist.methods.exact_sums"
            )
        out[key] = value.astype(np.int64, copy=False)
    return out


def _add(totals: dict[str, np.ndarray], stats: Mapping[str, np.ndarray]) -> None:
    """Add int64 statistics into `totals`, by key (sums of integers: any order)."""
    for key, value in stats.items():
        totals[key] = totals[key] + value if key in totals else np.array(value, dtype=np.int64)


def add_up(
    result: UnitResult,
    totals: dict[str, np.ndarray],
    nonfinite: dict[str, list[int]],
    checked: PrecisionCounts | None = None,
) -> None:
    """Add a reduce result's statistics to `totals`, its NaN/Inf counts to `nonfinite` and
    its precision check to `checked` (sums of integers: the order never matters)."""
    _add(totals, result.stats or {})
    if checked is not None:
        checked.merge(result.precision)
    for name, counts in (result.nonfinite or {}).items():
        old = nonfinite.get(name, [0] * len(counts))
        nonfinite[name] = [a + b for a, b in zip(old, counts, strict=True)]


def reduce_group(
    units: tuple[WorkUnit, ...], context: TaskContext, round_: int, check_finite: bool
) -> UnitResult:
    """`reduce_unit` over units one task reads together (those of one output part, so the
    map pass, which makes the part in one task, finds all their bytes in this node's input
    cache), the results summed."""
    with worker_context().work() as scope:
        results = [reduce_unit(u, context, round_, check_finite, scope) for u in units]
        totals: dict[str, np.ndarray] = {}
        nonfinite: dict[str, list[int]] = {}
        checked = PrecisionCounts.zeros(input_count(context.layout) - 1) if check_finite else None
        for r in results:
            add_up(r, totals, nonfinite, checked)
        return UnitResult(
            units[0].index,
            Statistics(totals),
            None,
            tuple(map(sum, zip(*(r.bytes_read for r in results), strict=True))),
            max(r.peak_rss_bytes for r in results),
            nonfinite or None,
            peak_private_bytes=scope.memory.note(),
            precision=checked,
            traffic=scope.traffic.total(),
            times=scope.clock.times(len(units)),
            lora_formed=scope.products.formed,
            lora_reused=scope.products.reused,
            **ran_by(),
        )


def _nonfinite(inputs: BlockInputs, fused: Fused, dev: str) -> list[int]:
    """NaN and Inf count of each input of a block: a quantized input's from its stored form
    (`kernels.stored_nonfinite`: its codes and scales say where a decoded value is not
    finite, so it is not decoded for this), the others' by a raw-bits sweep where kernels are
    on, else by torch."""
    forms = inputs.encoded or (None,) * len(inputs.dtypes)
    counts = [None if f is None else stored_nonfinite.count(f) for f in forms]
    for i, d in enumerate(inputs.dtypes):
        if counts[i] is not None:
            continue
        if fused.on:
            from ram_dist.kernels import scan_numba

            if scan_numba.supports(d):
                counts[i] = scan_numba.nonfinite_in(inputs.value(i), d)
                continue
        import torch

        x = tensor_from_bytes(inputs.value(i), d)
        counts[i] = int((~torch.isfinite(x)).sum())
    return [int(c) for c in counts]  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _needs_check(dtypes: tuple[str, ...]) -> bool:
    """`precision.needs_check` of a tensor's inputs' value dtypes (base first), asked once
    per dtypes."""
    return precision.needs_check(dtypes[0], list(dtypes[1:]))


def _check_counts(
    inputs: BlockInputs, fused: Fused, params: TensorParams, swept: np.ndarray | None
) -> np.ndarray:
    """The precision check of a block (int64 [N, 3]): as the method's sweep counted it
    (`swept`), else by the fused kernel where kernels are on (an FP8 input read as stored),
    else by the numpy rule; `epsilon` the method's threshold of a change where it has one
    (RAM's), else RAM's default."""
    eps = params.get("epsilon")
    eps = float(eps) if isinstance(eps, float) else EPSILON.default
    if swept is not None:
        counts = swept
    elif fused.take(inputs.dtypes):
        from ram_dist.kernels import precision_numba

        counts = precision_numba.check_counts(inputs.arrays(encoded=True), eps)
    else:
        raw = zip(inputs.raw, inputs.dtypes, strict=True)
        counts = precision.check_counts([r.view(INFO[d].numpy) for r, d in raw], eps)
    if not precision.counts_rounding(inputs.dtypes[0]):  # a 16-bit base: overflow only
        counts[:, [precision.CHANGED, precision.ROUNDING]] = 0
    return counts
