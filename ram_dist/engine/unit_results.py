"""What a worker task sends back to the driver (`UnitResult`), and the compact pickling of
a reduce task's statistics."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ram_dist.engine.timeline import TaskTimes
from ram_dist.io.range_cache import CacheTraffic
from ram_dist.io.sinks import PartReceipt


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
    receipts: tuple[PartReceipt, ...] = ()
    """Map pass: the same part of each further output (`PartWork.also`), in order."""
    gpus: tuple[str, ...] = ()
    """The Ray GPU ids the task held (none: a CPU task, or run outside Ray)."""
    worker: str = ""
    """The process that ran the task: `host:pid`."""
    attempt: int = 0
    """Ray's attempt number of the task: above 0 when an earlier attempt was lost (its worker
    or node died) and Ray ran it again."""
    traffic: CacheTraffic = field(default_factory=CacheTraffic)
    """Bytes the task read from this node's input cache and wrote to it."""
    times: TaskTimes | None = None
    """When the task ran and where its time went (`engine.timeline`)."""
    precision: PrecisionCounts | None = None
    """Reduce round 0: the precision check of the unit's tensors that need one."""
    lora_formed: int = 0
    """Elements of LoRA task values whose product the task formed (`engine.kept_values`)."""
    lora_reused: int = 0
    """Elements of LoRA task values the task took as an earlier pass kept them."""
    kernels_compiled: dict[str, int] = field(default_factory=dict)
    """Kernel signatures the task's process compiled since its previous task, per kernel
    (`kernels.shared_cache.take_compiled`): none where they were in numba's cache."""


@dataclass
class PrecisionCounts:
    """The first reduce round's precision check (`kernels.precision.check_counts`) of some
    units, per task: the elements it changed and those of them that are only the base
    rounded to a 16-bit dtype, over the tensors checked; and per tensor whose base values
    overflow a task's precision, the count per task."""

    changed: list[int]
    rounding: list[int]
    overflow: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def zeros(cls, tasks: int) -> PrecisionCounts:
        return cls([0] * tasks, [0] * tasks)

    def add(self, tensor: str, counts: np.ndarray) -> None:
        """Add a chunk's `check_counts` (int64 [N, 3]) of `tensor`."""
        for t, (changed, rounding, overflow) in enumerate(counts.tolist()):
            self.changed[t] += changed
            self.rounding[t] += rounding
            if overflow:
                row = self.overflow.setdefault(tensor, [0] * len(self.changed))
                row[t] += overflow

    def merge(self, other: PrecisionCounts | None) -> None:
        """Add another result's counts (sums of integers: any order)."""
        if other is None:
            return
        self.changed = [a + b for a, b in zip(self.changed, other.changed, strict=True)]
        self.rounding = [a + b for a, b in zip(self.rounding, other.rounding, strict=True)]
        for name, row in other.overflow.items():
            mine = self.overflow.setdefault(name, [0] * len(row))
            self.overflow[name] = [a + b for a, b in zip(mine, row, strict=True)]


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
