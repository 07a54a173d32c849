"""Check that the inputs fit together and describe every tensor for the workers.

Runs on the driver, on headers only, before any tensor byte is read: a task missing a base
tensor, holding an extra one, or with another shape stops the job here, naming the model,
the tensor and the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ram_dist.dtypes import FLOATING, itemsize
from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo
from ram_dist.io.storage import join
from ram_dist.io.writer import OutTensor
from ram_dist.units import TensorSlot


@dataclass(frozen=True)
class Source:
    """Where one input's bytes of a tensor start, and their dtype."""

    file: str
    start: int
    dtype: str


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the workers see it: its inputs (base first) and its output dtype."""

    name: str
    shape: tuple[int, ...]
    participating: bool
    out_dtype: str
    sources: tuple[Source, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """Every tensor, and the output shards (base's file names, base's tensor order)."""

    tensors: dict[str, TensorEntry]
    shards: dict[str, tuple[str, ...]]
    sharded: bool

    def out_tensors(self, shard: str) -> list[OutTensor]:
        return [
            OutTensor(n, self.tensors[n].out_dtype, self.tensors[n].shape)
            for n in self.shards[shard]
        ]

    def slots(self) -> list[TensorSlot]:
        """Planner input, in output order; copied tensors read the base only."""
        slots = []
        for shard, names in self.shards.items():
            for n in names:
                e = self.tensors[n]
                used = e.sources if e.participating else e.sources[:1]
                row = math.prod(e.shape[1:]) if len(e.shape) > 1 else 1
                widest = max(itemsize(s.dtype) for s in used)
                slots.append(TensorSlot(n, shard, e.numel, row, widest))
        return slots


def build_layout(base: Checkpoint, tasks: list[Checkpoint], out_dtype: str | None) -> Layout:
    """Validate names, shapes and dtype kinds of all inputs against the base."""
    for task in tasks:
        _check_names(base, task)
    tensors: dict[str, TensorEntry] = {}
    for name, b in base.tensors.items():
        infos = [b] + [t.tensors[name] for t in tasks]
        for task, info in zip(tasks, infos[1:], strict=True):
            if info.shape != b.shape:
                raise CheckpointError(
                    f"tensor {name!r}: shape {list(info.shape)} in {task.describe(name)} "
                    f"differs from {list(b.shape)} in {base.describe(name)}"
                )
            if (info.dtype in FLOATING) != (b.dtype in FLOATING):
                raise CheckpointError(
                    f"tensor {name!r}: dtype {info.dtype} in {task.describe(name)} and "
                    f"{b.dtype} in {base.describe(name)} are not both floating point"
                )
        participating = b.dtype in FLOATING
        tensors[name] = TensorEntry(
            name=name,
            shape=b.shape,
            participating=participating,
            out_dtype=(out_dtype or b.dtype) if participating else b.dtype,
            sources=tuple(Source(i.file, i.start, i.dtype) for i in infos),
        )
    # One pass over the tensors, grouped by file (in the base's order), then each file's by
    # byte offset: not one pass over all tensors per file.
    in_file: dict[str, list[TensorInfo]] = {}
    for info in base.tensors.values():
        in_file.setdefault(info.file, []).append(info)
    shards: dict[str, tuple[str, ...]] = {}
    for file in base.files:
        in_this = in_file.get(join(base.url, file), [])
        shards[file] = tuple(i.name for i in sorted(in_this, key=lambda i: i.start))
    return Layout(tensors=tensors, shards=shards, sharded=base.sharded)


def _check_names(base: Checkpoint, task: Checkpoint) -> None:
    missing = sorted(base.tensors.keys() - task.tensors.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{task.label} ({task.url}) has no tensor {missing[0]!r}{more}, which the "
            f"{base.describe(missing[0])} holds; every task must hold exactly the base's tensors"
        )
    extra = sorted(task.tensors.keys() - base.tensors.keys())
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{task.describe(extra[0])} holds tensor {extra[0]!r}{more}, which the "
            f"{base.label} ({base.url}) does not; every task must hold exactly the base's tensors"
        )
