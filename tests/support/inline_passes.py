"""A merge's passes run by the worker functions inline, unit by unit in this process (no
Ray), as `engine.passes` sends them to the workers: what the engine tests use to watch what
a worker does (which inputs it decodes) while checking the bytes it writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ram_dist.dtypes import itemsize
from ram_dist.engine import driver, map_step, reduce_step, worker
from ram_dist.io.sinks import DriverTarget
from ram_dist.methods import get_method
from ram_dist.methods.protocol import RoundTotals
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.units import Part

FUSED = worker.WorkFlags(fused=True)


def merge_inline(
    base: Path,
    tasks: list[Path],
    method_name: str,
    flags: worker.WorkFlags = FUSED,
    on_pass: Callable[[str], None] | None = None,
    **kw,
) -> dict[str, bytes]:
    """Both passes, unit by unit in this process; the output tensors' bytes by name.
    `on_pass` is told "round <r>" and "map" as each pass starts; `kw` are `MergeConfig`'s
    (a unit budget of 700 bytes unless given)."""
    kw.setdefault("unit_budget_bytes", 700)
    config = MergeConfig(
        base=str(base), tasks=tuple(str(t) for t in tasks), method=method_name, **kw
    )  # fmt: skip
    job = driver.prepare(config)
    method, state = get_method(method_name), job.initial_state()
    for round_ in range(method.rounds):
        if on_pass is not None:
            on_pass(f"round {round_}")
        totals: dict[str, np.ndarray] = {}
        for unit in job.units:
            with worker.worker_context().work() as scope:
                context = worker.TaskContext(
                    job.layout, job.storage, method, job.params, state, flags
                )
                got = reduce_step.reduce_unit(unit, context, round_, False, scope)
            reduce_step.add_up(got, totals, {})
        sums = {key: torch.from_numpy(value) for key, value in totals.items()}
        state = method.finalize(RoundTotals(round_, sums, job.params, job.numel(), state))
    if on_pass is not None:
        on_pass("map")
    pieces: dict[str, list[tuple[int, bytes]]] = {}
    for unit in job.units:
        part = Part(unit.shard, 1, (unit.index,), 0, map_step.unit_out_bytes(unit, job.layout))
        work = map_step.PartWork(part, (unit,), b"", DriverTarget("inline"))
        context = worker.TaskContext(job.layout, job.storage, method, job.params, state, flags)
        data = map_step.map_part(work, context).receipt.data.tobytes()
        at = 0
        for p in unit.pieces:
            size = p.numel * itemsize(job.layout.tensors[p.tensor].out_dtype)
            pieces.setdefault(p.tensor, []).append((p.start, data[at : at + size]))
            at += size
    return {name: b"".join(b for _, b in sorted(parts)) for name, parts in pieces.items()}


def check_round_inline(
    base: Path, tasks: list[Path], method_name: str, flags: worker.WorkFlags = FUSED, **kw
) -> dict[str, list[int]]:
    """The first reduce round with the NaN/Inf check (`check_finite`), unit by unit in this
    process: per tensor, each input's count of non-finite values (none: {})."""
    kw.setdefault("unit_budget_bytes", 700)
    config = MergeConfig(
        base=str(base), tasks=tuple(str(t) for t in tasks), method=method_name, **kw
    )  # fmt: skip
    job = driver.prepare(config)
    method, state = get_method(method_name), job.initial_state()
    found: dict[str, list[int]] = {}
    for unit in job.units:
        with worker.worker_context().work() as scope:
            context = worker.TaskContext(job.layout, job.storage, method, job.params, state, flags)
            got = reduce_step.reduce_unit(unit, context, 0, True, scope)
        reduce_step.add_up(got, {}, found)
    return found
