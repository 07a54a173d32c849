"""Run a plain function over work units on Ray, a bounded number at a time, in order.

Runs on the driver. The pool knows nothing of merging: it submits `fn(item, *shared)` as
Ray tasks, keeps at most `max_in_flight` running (back-pressure bounds memory), and yields
results in submission order so the map pass can append them to shards as they come, each
with the node it ran on (so a later pass can send the item back there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ram_dist.errors import RamDistError


@ray.remote
def _run(fn: Callable[..., Any], item: Any, *shared: Any) -> tuple[str, Any]:
    return ray.get_runtime_context().get_node_id(), fn(item, *shared)


def ordered_map(
    fn: Callable[..., Any],
    items: Iterable[Any],
    shared: tuple[Any, ...],
    max_in_flight: int,
    resources: dict[str, Any],
    options_of: Callable[[Any], dict[str, Any] | None] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yield `(node id, fn(item, *shared))` for each item, in order, with Ray doing the work.

    `shared` values are put in the object store once. `options_of(item)` may add Ray options
    for one item (e.g. a scheduling strategy). A worker's `RamDistError` is raised again
    here as itself, so the user sees its message rather than a Ray traceback.
    """
    remote = _run.options(**resources)
    shared_refs = tuple(ray.put(v) for v in shared)
    pending: deque[ray.ObjectRef] = deque()
    try:
        for item in items:
            extra = options_of(item) if options_of is not None else None
            task = _run.options(**resources, **extra) if extra else remote
            pending.append(task.remote(fn, item, *shared_refs))
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


def near(node_id: str | None) -> dict[str, Any] | None:
    """Ray options that send a task to `node_id` while that node lives (else anywhere)."""
    if node_id is None:
        return None
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}


@ray.remote(num_cpus=0, max_retries=0)
def _run_here(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def on_every_node(fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """`fn(*args)` once on each alive node, for node-local housekeeping (no CPU asked, so it
    never waits behind work). A node that fails or does not answer in time is left out."""
    refs = {
        node["NodeID"]: _run_here.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(fn, *args)
        for node in ray.nodes()
        if node.get("Alive")
    }
    ready, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    done: dict[str, Any] = {}
    for node, ref in refs.items():
        if ref in ready:
            try:
                done[node] = ray.get(ref)
            except ray.exceptions.RayError:
                continue
    return done
