"""Run a plain function over work items on Ray, a bounded number at a time.

Runs on the driver. The pool knows nothing of merging: it submits `fn(item, *shared)` as
Ray tasks, keeps at most `max_in_flight` submitted (back-pressure bounds memory), and yields
each result as it finishes, with its item and the node it ran on (so a later pass can send
the item back there).
"""

from __future__ import annotations

import gc
import logging
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ram_dist.errors import RamDistError
from ram_dist.io.failures import is_storage_failure, storage_error

log = logging.getLogger(__name__)


class Shared:
    """A value put in Ray's object store once (on the driver), for every task that takes it
    among `unordered_map`'s `shared` values: each worker process fetches and deserializes
    it once, and keeps it for the next task, instead of once per task (a layout of 100k
    tensors takes seconds to deserialize). Handed to the task's function as the value."""

    #: Values a worker process keeps, by object id: the latest few (one job's, mostly).
    KEPT = 4
    _kept: OrderedDict[str, Any] = OrderedDict()
    _lock = threading.Lock()

    def __init__(self, value: Any) -> None:
        # The standard pickler: Ray's (cloudpickle) calls back into Python for every object,
        # a third slower on a layout's 400k objects. `value` needs nothing more.
        self.ref = ray.put(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def get(self) -> Any:
        key = self.ref.hex()
        with Shared._lock:
            if key in Shared._kept:
                Shared._kept.move_to_end(key)
                return Shared._kept[key]
        value = _settled(lambda: pickle.loads(ray.get(self.ref)))
        with Shared._lock:
            Shared._kept[key] = value
            while len(Shared._kept) > Shared.KEPT:
                Shared._kept.popitem(last=False)
        return value


def _settled(make: Callable[[], Any]) -> Any:
    """`make()`, with Python's cyclic garbage collector paused while it builds, then told to
    leave what exists alone for good (`gc.freeze`): the layout of 100k tensors is 400k
    objects, which every full collection in this process would otherwise scan again, while
    it is built and then while each later task's arguments are deserialized (seconds per
    pass). Cycles already unreachable are collected first, so that none is kept."""
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        value = make()
        gc.freeze()
    finally:
        if collecting:
            gc.enable()
    return value


def _run(fn: Callable[..., Any], item: Any, *shared: Any) -> tuple[str, Any]:
    values = [s.get() if isinstance(s, Shared) else s for s in shared]
    return ray.get_runtime_context().get_node_id(), fn(item, *values)


#: Ray titles a worker running these `ray::_run` (tests find the workers to kill by it).
_run_anywhere = ray.remote(_run)
#: The same in a worker process that exits after one task: Ray takes `max_calls` only where a
#: function is declared, never from `.options()`, so `resources` asking for `max_calls: 1`
#: get this one.
_run_once = ray.remote(max_calls=1)(_run)


def unordered_map(
    fn: Callable[..., Any],
    items: Iterable[Any],
    shared: tuple[Any, ...],
    max_in_flight: int,
    resources: dict[str, Any],
    options_of: Callable[[Any], dict[str, Any] | None] | None = None,
) -> Iterator[tuple[Any, str, Any]]:
    """Yield `(item, node id, fn(item, *shared))` for each item as it finishes, with Ray
    doing the work and at most `max_in_flight` items submitted at once (back-pressure
    bounds memory); one slow item never holds back the others' results.

    `shared` values are put in the object store once (a `Shared` one is already there, and
    each worker process deserializes it once, whatever the map). `options_of(item)` may add
    Ray options for one item (e.g. a scheduling strategy). `resources` may hold `max_calls:
    1` (a fresh worker process per task). A worker's `RamDistError` (a `StorageError` naming
    the file it could not read or write, among others) is raised again here as itself, and a
    store's failure no layer named as a `StorageError`, so the user sees one line rather
    than a Ray traceback; the task's traceback is logged at debug level.
    """
    resources = dict(resources)
    max_calls = resources.pop("max_calls", 0)
    if max_calls not in (0, 1):
        raise ValueError(f"max_calls must be 0 (no limit) or 1, got {max_calls}")
    run = _run_once if max_calls == 1 else _run_anywhere
    remote = run.options(**resources)
    shared_refs = tuple(v if isinstance(v, Shared) else ray.put(v) for v in shared)
    pending: dict[ray.ObjectRef, Any] = {}
    queue = iter(items)
    more = True
    try:
        while True:
            while more and len(pending) < max_in_flight:
                item = next(queue, _END)
                if item is _END:
                    more = False
                    break
                extra = options_of(item) if options_of is not None else None
                task = run.options(**resources, **extra) if extra else remote
                pending[task.remote(fn, item, *shared_refs)] = item
            if not pending:
                return
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                item = pending.pop(ref)
                node, result = _get(ref)
                yield item, node, result
    finally:
        _drop(list(pending))


_END = object()
#: Seconds to wait for tasks cancelled when a map stops early.
DRAIN_S = 5.0


def _drop(refs: list[ray.ObjectRef]) -> None:
    """Cancel tasks still in flight when a map stops early (a task failed), and collect what
    they end with: a result dropped unread that holds an error (another task failing the same
    way) is logged by Ray, traceback and all, as an unhandled error. Logged here at debug."""
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=DRAIN_S)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001  (the job is failing already, for its own reason)
            log.debug("a task ended after the map stopped: %s", e)


def _get(ref: ray.ObjectRef) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RamDistError):
            log.debug("a task failed: %s", e)
            raise e.cause from None
        if e.cause is not None and is_storage_failure(e.cause):
            log.debug("a task failed: %s", e)
            raise storage_error(e.cause, None, "read or write") from None
        raise


def near(node_id: str | None, only: bool = False) -> dict[str, Any] | None:
    """Ray options that send a task to `node_id` while that node lives (else anywhere), or,
    with `only`, to that node and no other."""
    if node_id is None:
        return None
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=not only)
    return {"scheduling_strategy": strategy}


def this_node() -> str:
    """The driver's own node."""
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> int:
    """Nodes of the cluster now alive."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


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
