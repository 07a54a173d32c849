"""Python's cyclic garbage collector: the one place ram-dist turns it off, on, or tells it to
leave objects alone. Driver and workers.

A job makes objects by the million and almost no reference cycles: the headers, layout,
parameters and units of a checkpoint of 100k tensors (a million objects), and a task's blocks
and statistics (by the hundred thousand). Every full collection scans all that survived so
far, for nothing, and costs seconds. So:

- planning and each task run with the collector `paused` (back as it was afterwards: the
  cycles made meanwhile are collected then);
- the passes run with the job's objects `frozen` (left alone until the job ends, then freed
  as usual);
- a worker process builds a shared value (`pool.Shared`: the layout, the parameters) with the
  collector paused and then `settled` for good, since it keeps the value for later tasks.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_LOCK = threading.Lock()
#: Blocks now inside `paused`, in any thread, and whether the collector ran before the first.
_PAUSES = [0, False]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block, and back as it was once the last of the blocks that
    overlap it (in any thread) ends: counted, so that a GPU worker's second thread does not
    turn it back on under the first. A caller that keeps it off keeps it off."""
    with _LOCK:
        if _PAUSES[0] == 0:
            _PAUSES[1] = gc.isenabled()
            gc.disable()
        _PAUSES[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _PAUSES[0] -= 1
            if _PAUSES[0] == 0 and _PAUSES[1]:
                gc.enable()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Every object that exists now left alone by the collector until the block ends
    (`gc.freeze`, then `gc.unfreeze`); they are still freed as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def settled(make: Callable[[], T]) -> T:
    """`make()`, built with the collector paused, then everything that exists left alone
    for good (`gc.freeze`): for a value this process keeps. Cycles already unreachable are
    collected first, so that none is kept."""
    gc.collect()
    with paused():
        value = make()
        gc.freeze()
    return value
