"""Where a pass's time goes, per worker: a task's own clock (`TaskClock`, kept by the worker
while it reads, computes and writes) and the pass's timeline (`PassTimeline`, on the driver:
per worker process, the tasks' times summed and the gaps between them).

A task's phases are timed with `time.perf_counter` around whole calls (a group of blocks
read, a block computed, a range hashed or written): a few calls per compute block, no cost
per element. Reading, and hashing and writing the output, run in threads of their own beside
the computing thread, so `read_s`, `hash_s` and `write_s` overlap the rest; what the
computing thread spends is split into `read_wait_s` (blocked on a read not yet done),
`compute_s` (between one block's inputs and the next request), `write_wait_s` (blocked on
writes still queued at the task's end) and `other_s` (the rest of the task: its setup,
statistics, the result). Between tasks, a worker is `idle_s`: waiting for Ray to hand it
the next one. Times of day (`time.time`) mark a task's start and end, so that the driver can
place tasks of several processes on one line.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: The phases a task's clock sums, in the report's order.
PHASES = ("read_s", "read_wait_s", "compute_s", "hash_s", "write_s", "write_wait_s")


class TaskClock:
    """The seconds one task spent in each phase (`PHASES`), and when it started. A phase is
    never added to by two threads at once (the reader's, the output thread's, or the
    computing thread's, which writes a whole part only once the output thread is done)."""

    def __init__(self) -> None:
        self.started = time.time()
        self._t0 = time.perf_counter()
        here = threading.current_thread()
        self.thread = "" if here is threading.main_thread() else here.name
        self.read_s = 0.0
        self.read_wait_s = 0.0
        self.compute_s = 0.0
        self.hash_s = 0.0
        self.write_s = 0.0
        self.write_wait_s = 0.0

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the time the `with` block takes to `phase`."""
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - t)

    def times(self, units: int) -> TaskTimes:
        """The task's times, now that it ends."""
        busy = time.perf_counter() - self._t0
        return TaskTimes(
            self.started,
            self.started + busy,
            units,
            {p: getattr(self, p) for p in PHASES},
            self.thread,
        )


@dataclass(frozen=True)
class TaskTimes:
    """What a task sends back of its clock: when it started and ended (time of day), the
    units it ran, and its seconds per phase (`PHASES`)."""

    started: float = 0.0
    ended: float = 0.0
    units: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    thread: str = ""
    """The thread that ran it, where not its process's main thread (a GPU worker's)."""

    @property
    def busy_s(self) -> float:
        return max(0.0, self.ended - self.started)


@dataclass
class _Worker:
    node: str
    tasks: list[TaskTimes] = field(default_factory=list)


@dataclass
class PassTimeline:
    """The tasks' times of one pass, per worker (`host:pid`, a GPU worker's thread after a
    slash), from `begin()` to `end()` on the driver."""

    started: float = 0.0
    ended: float = 0.0
    workers: dict[str, _Worker] = field(default_factory=dict)

    def begin(self) -> None:
        self.started = time.time()

    def end(self) -> None:
        self.ended = time.time()

    def add(self, worker: str, node: str, times: TaskTimes | None) -> None:
        if times is None or not times.ended:
            return
        self.workers.setdefault(worker, _Worker(node)).tasks.append(times)

    def as_dict(self) -> dict[str, Any]:
        """Per worker and in total: units, tasks, seconds per phase, `busy_s` (in tasks),
        `other_s` (busy, not in a computing-thread phase), `idle_s` (between its tasks),
        and `before_first_s`/`after_last_s` (the pass running, the worker not yet or no
        longer given a task); `wall_s`, the pass's own, for the ratios."""
        wall = max(0.0, self.ended - self.started)
        rows = [self._row(name, w) for name, w in sorted(self.workers.items())]
        total: dict[str, Any] = {"workers": len(rows)}
        for key in ("units", "tasks"):
            total[key] = sum(r[key] for r in rows)
        for key in (*PHASES, "busy_s", "other_s", "idle_s", "before_first_s", "after_last_s"):
            total[key] = round(sum(r[key] for r in rows), 4)
        capacity = wall * len(rows)
        total["busy_share"] = round(total["busy_s"] / capacity, 4) if capacity > 0 else None
        return {"wall_s": round(wall, 4), "total": total, "workers": rows}

    def _row(self, name: str, worker: _Worker) -> dict[str, Any]:
        tasks = sorted(worker.tasks, key=lambda t: t.started)
        idle, last = 0.0, None
        for t in tasks:
            if last is not None:
                idle += max(0.0, t.started - last)
            last = t.ended if last is None else max(last, t.ended)
        busy = sum(t.busy_s for t in tasks)
        sums = {p: sum(t.phases.get(p, 0.0) for t in tasks) for p in PHASES}
        thread = sums["read_wait_s"] + sums["compute_s"] + sums["write_wait_s"]
        row: dict[str, Any] = {"worker": name, "node": worker.node}
        row |= {"units": sum(t.units for t in tasks), "tasks": len(tasks)}
        row |= {p: round(v, 4) for p, v in sums.items()}
        row |= {
            "busy_s": round(busy, 4),
            "other_s": round(max(0.0, busy - thread), 4),
            "idle_s": round(idle, 4),
            "before_first_s": round(max(0.0, tasks[0].started - self.started), 4),
            "after_last_s": round(max(0.0, self.ended - (last or self.ended)), 4),
        }
        return row
