"""Which elements of which tensor each work unit covers.

A work unit is a list of pieces (a tensor and a flat element range) that are contiguous in
one output shard, so its merged bytes can be appended to that shard as they are. The budget
bounds the bytes a unit reads from each input: a large tensor is cut into whole rows (or,
when one row is larger than the budget, into element ranges), small tensors are packed
together. Every split gives the same merged bytes: the rule is element-wise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ram_dist.errors import RamDistError


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
    """What the planner needs of a tensor: its size, row length and widest input dtype."""

    name: str
    shard: str
    numel: int
    row: int
    max_itemsize: int


def plan_units(slots: list[TensorSlot], budget_bytes: int) -> list[WorkUnit]:
    """Cut tensors (in output order) into units reading at most `budget_bytes` per input."""
    widest = max((s.max_itemsize for s in slots), default=1)
    if budget_bytes < widest:
        raise RamDistError(
            f"chunk budget of {budget_bytes} bytes cannot hold one element ({widest} bytes)"
        )
    units: list[WorkUnit] = []
    pieces: list[Piece] = []
    used = 0
    shard = None

    def flush() -> None:
        nonlocal pieces, used
        if pieces:
            units.append(WorkUnit(index=len(units), shard=shard or "", pieces=tuple(pieces)))
        pieces, used = [], 0

    for slot in slots:
        if slot.shard != shard:
            flush()
            shard = slot.shard
        if slot.numel == 0:
            pieces.append(Piece(slot.name, 0, 0))
            continue
        pos = 0
        while pos < slot.numel:
            fit = (budget_bytes - used) // slot.max_itemsize
            rest = slot.numel - pos
            if rest <= fit:
                take = rest
            elif slot.row * slot.max_itemsize <= budget_bytes:
                take = (fit // slot.row) * slot.row  # whole rows only
            else:
                take = fit  # one row exceeds the budget: split inside the row
            if take == 0:
                flush()
                continue
            pieces.append(Piece(slot.name, pos, pos + take))
            used += take * slot.max_itemsize
            pos += take
            if pos < slot.numel:
                flush()
    flush()
    return units
