"""Which elements of which tensor each work unit covers.

A work unit is a list of pieces (a tensor and a flat element range) that are contiguous in
one output shard, so its merged bytes can be appended to that shard as they are. The budget
bounds the bytes a unit reads from each input: a large tensor is cut into whole rows (or,
when one row is larger than the budget, into element ranges), small tensors are packed
together. Every split gives the same merged bytes: the rule is element-wise. A tensor whose
rows are `atomic` (the bands of an FP8 weight, each the height of its blocks) is cut only
between them, and a unit takes at least one even when it is over the budget; one that fits
a unit whole starts a unit rather than be cut (its new scales, next, then need no band
merged again).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from ram_dist.errors import RamDistError
from ram_dist.io.s3 import MAX_PARTS, MIN_PART_BYTES


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of a tensor, in flat (row-major) order."""

    tensor: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WorkUnit:
    """Pieces that follow each other in one output shard; `index` orders units globally."""

    index: int
    shard: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class TensorSlot:
    """What the planner needs of a tensor: its size, row length and the bytes one element
    reads from an input (its widest input's; a fraction for a packed format)."""

    name: str
    shard: str
    numel: int
    row: int
    max_itemsize: float
    atomic: bool = False
    """Cut only between rows, never inside one, whatever the budget."""
    follows: str | None = None
    """The tensor this one is computed from (an FP8 weight, for its new scales): free to
    read when the unit already holds all of that tensor."""


#: Most pieces in one unit: a unit costs per piece too (a range read from each input, a
#: kernel call), so a unit of many small tensors is cut as one of many bytes is, and its
#: work spreads over the workers (100k one-element tensors: 13 units, not one).
MAX_PIECES = 8192


def plan_units(
    slots: list[TensorSlot], budget_bytes: int, max_pieces: int = MAX_PIECES
) -> list[WorkUnit]:
    """Cut tensors (in output order) into units reading at most `budget_bytes` per input
    (one atomic row may be more), of at most `max_pieces` pieces."""
    widest = max((s.max_itemsize for s in slots if not s.atomic), default=1)
    if budget_bytes < widest:
        raise RamDistError(
            f"unit budget of {budget_bytes} bytes cannot hold one element ({widest} bytes)"
        )
    units: list[WorkUnit] = []
    pieces: list[Piece] = []
    whole: set[str] = set()  # tensors the unit being filled holds all of
    used = 0
    shard = None

    def flush() -> None:
        nonlocal pieces, used
        if pieces:
            units.append(WorkUnit(index=len(units), shard=shard or "", pieces=tuple(pieces)))
        pieces, used = [], 0
        whole.clear()

    for slot in slots:
        if slot.shard != shard:
            flush()
            shard = slot.shard
        if len(pieces) >= max_pieces and slot.follows not in whole:
            flush()
        if slot.numel == 0:
            pieces.append(Piece(slot.name, 0, 0))
            continue
        whole_cost = slot.numel * slot.max_itemsize
        if slot.atomic and slot.follows is None and used + whole_cost > budget_bytes >= whole_cost:
            flush()  # a whole FP8 weight in one unit, its scales after it: no band merged twice
        pos = 0
        while pos < slot.numel:
            rest = slot.numel - pos
            cost = 0 if slot.follows is not None and slot.follows in whole else slot.max_itemsize
            fit = int(max(0, budget_bytes - used) // cost) if cost else rest
            if rest <= fit:
                take = rest
            elif slot.atomic or slot.row * slot.max_itemsize <= budget_bytes:
                take = (fit // slot.row) * slot.row  # whole rows only
                if take == 0 and slot.atomic and not pieces:
                    take = min(slot.row, rest)  # one row over the budget: it cannot be cut
            else:
                take = fit  # one row exceeds the budget: split inside the row
            if take == 0:
                flush()
                continue
            pieces.append(Piece(slot.name, pos, pos + take))
            if take == slot.numel:
                whole.add(slot.name)
            used += take * cost
            pos += take
            if pos < slot.numel:
                flush()
    flush()
    return units


@dataclass(frozen=True)
class Part:
    """Bytes [start, stop) of an output shard, made by one task from consecutive units.

    `number` counts from 1 within the shard (a multipart upload's part number); part 1
    starts at byte 0 and so holds the shard's safetensors header before its units' bytes.
    """

    shard: str
    number: int
    units: tuple[int, ...]
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_parts(
    units: list[WorkUnit],
    unit_bytes: dict[int, int],
    header_bytes: dict[str, int],
    min_part_bytes: int = MIN_PART_BYTES,
    max_parts: int = MAX_PARTS,
) -> list[Part]:
    """Group each shard's units, in order, into parts of at least `min_part_bytes` (all but a
    shard's last) and at most `max_parts` per shard. `unit_bytes` is each unit's output size;
    `header_bytes` the header size of each shard to plan (part 1 carries it), in order. Every
    unit of such a shard must be in `units`: a part's place follows from all before it."""
    by_shard: dict[str, list[WorkUnit]] = {shard: [] for shard in header_bytes}
    for unit in units:
        if unit.shard in by_shard:
            by_shard[unit.shard].append(unit)
    parts: list[Part] = []
    for shard, members in by_shard.items():
        size = header_bytes[shard] + sum(unit_bytes[u.index] for u in members)
        target = max(min_part_bytes, -(-size // max_parts), 1)
        groups: list[list[WorkUnit]] = [[]]
        filled = header_bytes[shard]
        for unit in members:
            if filled >= target and groups[-1]:
                groups.append([])
                filled = 0
            groups[-1].append(unit)
            filled += unit_bytes[unit.index]
        if len(groups) > 1 and filled == 0:  # a last part of empty tensors only
            last = groups.pop()
            groups[-1] += last
        start = 0
        for number, group in enumerate(groups, 1):
            stop = start + sum(unit_bytes[u.index] for u in group)
            if number == 1:
                stop += header_bytes[shard]
            parts.append(Part(shard, number, tuple(u.index for u in group), start, stop))
            start = stop
    return parts


def parts_as_recorded(
    shard: str,
    units: list[WorkUnit],
    itemsize: dict[str, int],
    header_bytes: int,
    ranges: list[list[int]],
    next_index: int,
    rows: Mapping[str, int] | None = None,
) -> tuple[list[Part], list[WorkUnit]] | None:
    """Cut a shard's `units` (in order) again so that its parts are the byte `ranges` a
    resumed run recorded, whatever unit budget planned the units now: a unit that straddles
    a range's end is split there (the new pieces get indices from `next_index` on). Returns
    the parts and the units, or None when the ranges do not tile the shard or one ends inside
    an element (or inside an atomic row: `rows` gives, per tensor cut only between rows,
    its row length in elements). `itemsize` is each tensor's output itemsize."""

    def nbytes(pieces: tuple[Piece, ...] | list[Piece]) -> int:
        return sum(p.numel * itemsize[p.tensor] for p in pieces)

    size = header_bytes + sum(nbytes(u.pieces) for u in units)
    starts = [r[0] for r in ranges]
    if not ranges or starts[0] != 0 or ranges[-1][1] != size or ranges[0][1] < header_bytes:
        return None
    if any(a[1] != b[0] or a[0] >= a[1] for a, b in zip(ranges, ranges[1:], strict=False)):
        return None
    cuts = [r[1] for r in ranges[:-1]]
    split: list[tuple[int, WorkUnit]] = []  # (byte where the unit starts, unit)
    k, at, fresh = 0, header_bytes, next_index
    for unit in units:
        pending: list[Piece] = []
        begin, index = at, unit.index
        for piece in unit.pieces:
            width, start = itemsize[piece.tensor], piece.start
            end = at + piece.numel * width
            while k < len(cuts) and cuts[k] < end:
                if cuts[k] > at:
                    if (cuts[k] - at) % width:
                        return None  # a recorded part ends inside an element
                    step = (cuts[k] - at) // width
                    if rows and piece.tensor in rows and (start + step) % rows[piece.tensor]:
                        return None  # a recorded part ends inside a band of FP8 blocks
                    pending.append(Piece(piece.tensor, start, start + step))
                    start, at = start + step, cuts[k]
                if cuts[k] == at and pending:
                    split.append((begin, WorkUnit(index, shard, tuple(pending))))
                    pending, begin, index, fresh = [], at, fresh, fresh + 1
                k += 1
            pending.append(Piece(piece.tensor, start, piece.stop))
            at = end
        split.append((begin, WorkUnit(index, shard, tuple(pending))))
    members: list[list[int]] = [[] for _ in ranges]
    for begin, unit in split:
        members[bisect.bisect_right(starts, begin) - 1].append(unit.index)
    parts = [Part(shard, n, tuple(m), lo, hi)
             for n, ((lo, hi), m) in enumerate(zip(ranges, members, strict=True), 1)]  # fmt: skip
    by_index = {u.index: u for _, u in split}
    for part in parts:
        made = nbytes([p for i in part.units for p in by_index[i].pieces])
        if made + (header_bytes if part.number == 1 else 0) != part.size:
            return None
    return parts, [u for _, u in split]
