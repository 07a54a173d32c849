"""Run a plain function over work units on Ray, a bounded number at a time, in order.

Runs on the driver. The pool knows nothing of merging: it submits `fn(item, *shared)` as
Ray tasks, keeps at most `max_in_flight` running (back-pressure bounds memory), and yields
results in submission order so the map pass can append them to shards as they come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray

from ram_dist.errors import RamDistError


@ray.remote
def _run(fn: Callable[..., Any], item: Any, *shared: Any) -> Any:
    return fn(item, *shared)


def ordered_map(
    fn: Callable[..., Any],
    items: Iterable[Any],
    shared: tuple[Any, ...],
    max_in_flight: int,
    resources: dict[str, float],
) -> Iterator[Any]:
    """Yield `fn(item, *shared)` for each item, in order, with Ray doing the work.

    `shared` values are put in the object store once. A worker's `RamDistError` is raised
    again here as itself, so the user sees its message rather than a Ray traceback.
    """
    remote = _run.options(**resources)
    shared_refs = tuple(ray.put(v) for v in shared)
    pending: deque[ray.ObjectRef] = deque()
    try:
        for item in items:
            pending.append(remote.remote(fn, item, *shared_refs))
            if len(pending) >= max_in_flight:
                yield _get(pending.popleft())
        while pending:
            yield _get(pending.popleft())
    finally:
        for ref in pending:
            ray.cancel(ref)


def _get(ref: ray.ObjectRef) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RamDistError):
            raise e.cause from None
        raise
