"""Run a plain function over work items on Ray, a bounded number at a time.

Runs on the driver. The pool knows nothing of merging: it submits `fn(item, *shared)` as
Ray tasks (or to long-lived workers: `engine.gpu`), keeps a bounded number submitted
(back-pressure bounds memory), and yields each result as it finishes, with its item and the
node it ran on (so a later pass can send the item back there). Small items bound for the
same place may travel together, several to a Ray task (`Batching`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ram_dist.engine import collector
from ram_dist.errors import RamDistError
from ram_dist.io.failures import is_storage_failure, storage_error

log = logging.getLogger(__name__)


class Shared:
    """A value put in Ray's object store once (on the driver), for every task that takes it
    among `unordered_map`'s `shared` values (or as a field of a dataclass among them): each
    worker process fetches and deserializes it once, and keeps it for the next task, instead
    of once per task (a layout of 100k tensors takes seconds to deserialize). Handed to the
    task's function as the value."""

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
        # built with the collector paused, then left alone for good: the layout of 100k
        # tensors is 400k objects, which every full collection in this process would
        # otherwise scan again, while each later task's arguments are deserialized
        value = collector.settled(lambda: pickle.loads(ray.get(self.ref)))
        with Shared._lock:
            Shared._kept[key] = value
            while len(Shared._kept) > Shared.KEPT:
                Shared._kept.popitem(last=False)
        return value


def _quiet_cancel_hook(unraisable: Any) -> None:
    """`ray.cancel` stops a task by raising `KeyboardInterrupt` in it; where that lands in a
    finalizer (a weakref callback), Python prints "Exception ignored in ..." with a traceback,
    which Ray relays to the driver's stderr under the job's own one-line error. The task was
    cancelled on purpose: say nothing. Anything else goes to Python's own hook."""
    if unraisable.exc_type is KeyboardInterrupt:
        return
    sys.__unraisablehook__(unraisable)


def run_item(fn: Callable[..., Any], item: Any, *shared: Any) -> tuple[str, Any]:
    """`fn(item, *shared)` where a worker runs it, with the node it ran on."""
    sys.unraisablehook = _quiet_cancel_hook
    values = [_resolved(s) for s in shared]
    return ray.get_runtime_context().get_node_id(), fn(item, *values)


def _resolved(value: Any) -> Any:
    """A shared value as the task's function takes it: a `Shared` one fetched (once per
    process), and so is each `Shared` field of a dataclass (a pass's context)."""
    if isinstance(value, Shared):
        return value.get()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        got = {
            f.name: v.get()
            for f in dataclasses.fields(value)
            if isinstance(v := getattr(value, f.name), Shared)
        }
        return dataclasses.replace(value, **got) if got else value
    return value


def _run(fn: Callable[..., Any], item: Any, *shared: Any) -> tuple[str, Any]:
    return run_item(fn, item, *shared)


def _each(fn: Callable[..., Any], items: tuple[Any, ...], *shared: Any) -> list[bytes]:
    """`fn` over the items of one batch, in order, in one task, each result pickled before
    the next item runs: a result may hold a view of memory the worker reuses for the next
    (a through-driver part's bytes are its reused output buffer)."""
    return [pickle.dumps(fn(item, *shared), protocol=pickle.HIGHEST_PROTOCOL) for item in items]


#: Ray titles a worker running these `ray::_run` (tests find the workers to kill by it).
_run_anywhere = ray.remote(_run)


@dataclass(frozen=True)
class Place:
    """Where an item should run: on `node` while it lives (else anywhere), or, with `only`,
    there and nowhere else."""

    node: str
    only: bool = False


class Lane(Protocol):
    """What runs `unordered_map`'s items: Ray tasks (`TaskLane`), or long-lived workers
    (`engine.gpu.GpuWorkers`). A lane counts its own items in flight."""

    def serves(self, place: Place | None) -> bool:
        """Whether it can run an item that must run at `place`."""
        ...

    def has_room(self, place: Place | None) -> bool:
        """Whether it takes another item for `place` now (always, with nothing in flight)."""
        ...

    def submit(
        self, fn: Callable[..., Any], item: Any, shared: tuple[Any, ...], place: Place | None
    ) -> ray.ObjectRef: ...

    def result(self, ref: ray.ObjectRef) -> tuple[str, Any]:
        """The node and value of a finished item, or its failure, raised as `get_result`
        does."""
        ...

    def forget(self, ref: ray.ObjectRef) -> None:
        """An item dropped unread (the map stopped early)."""
        ...


class TaskLane:
    """Each item a Ray task of `resources`, at most `capacity` in flight."""

    def __init__(self, resources: dict[str, Any], capacity: int) -> None:
        self._run = _run_anywhere
        self._resources = dict(resources)
        self._remote = self._run.options(**self._resources)
        self._capacity = max(1, capacity)
        self._in_flight = 0

    def serves(self, place: Place | None) -> bool:
        return True

    def has_room(self, place: Place | None) -> bool:
        return self._in_flight < self._capacity

    def submit(
        self, fn: Callable[..., Any], item: Any, shared: tuple[Any, ...], place: Place | None
    ) -> ray.ObjectRef:
        task = self._remote
        if place is not None:
            strategy = NodeAffinitySchedulingStrategy(place.node, soft=not place.only)
            task = self._run.options(**self._resources, scheduling_strategy=strategy)
        self._in_flight += 1
        return task.remote(fn, item, *shared)

    def result(self, ref: ray.ObjectRef) -> tuple[str, Any]:
        self._in_flight -= 1
        return get_result(ref)

    def forget(self, ref: ray.ObjectRef) -> None:
        self._in_flight -= 1


@dataclass(frozen=True)
class Batching:
    """Consecutive items bound for the same place as Ray tasks travel as one task until
    their summed `weight` reaches `least`. A Ray task costs the driver milliseconds to
    submit and collect, and its worker as much to take up: the work of a small item, so a
    job of many small items spends most of its time on them. A batch's items run one after
    the other, so a task still holds one item's memory; their results come back together."""

    weight: Callable[[Any], int]
    least: int


@dataclass(frozen=True)
class Routing:
    """Where `unordered_map`'s items run: `place_of(item)` may say where an item should run;
    the items `on_gpu` says so of go to the `gpu` lane (as it has room), unless it cannot
    run them where `place_of` says they must run. By default, anywhere, as Ray tasks, one
    item to a task unless `batching` says otherwise (a GPU lane's items go one by one)."""

    place_of: Callable[[Any], Place | None] | None = None
    gpu: Lane | None = None
    on_gpu: Callable[[Any], bool] | None = None
    batching: Batching | None = None

    def lane(self, item: Any, tasks: Lane) -> tuple[Place | None, Lane]:
        """Where `item` must or should run, and the lane that runs it."""
        place = self.place_of(item) if self.place_of is not None else None
        to_gpu = self.gpu is not None and self.on_gpu is not None and self.on_gpu(item)
        return place, (self.gpu if to_gpu and self.gpu.serves(place) else tasks)  # type: ignore[union-attr]

    def groups(self, items: Iterable[Any], tasks: Lane) -> Iterator[_Group]:
        """The items in the groups they travel in, in order: a group is one item, or with
        `batching`, consecutive items for `tasks` at one place up to its weight."""
        batching, group = self.batching, None
        for item in items:
            place, lane = self.lane(item, tasks)
            if group is not None and (lane is not tasks or place != group.place):
                yield group
                group = None
            if group is None:
                group = _Group([], place, lane)
            group.items.append(item)
            if batching is not None and lane is tasks:
                group.weight += batching.weight(item)
                if group.weight < batching.least:
                    continue  # room for the next item, if it goes to the same place
            yield group
            group = None
        if group is not None:
            yield group


@dataclass
class _Group:
    """Items that travel together (`Routing.groups`)."""

    items: list[Any]
    place: Place | None
    lane: Lane
    weight: int = 0


def unordered_map(
    fn: Callable[..., Any],
    items: Iterable[Any],
    shared: tuple[Any, ...],
    max_in_flight: int,
    resources: dict[str, Any],
    routing: Routing = Routing(),
) -> Iterator[tuple[Any, str, Any]]:
    """Yield `(item, node id, fn(item, *shared))` for each item as it finishes, with Ray
    doing the work and at most `max_in_flight` items submitted at once as tasks of
    `resources` (back-pressure bounds memory); one slow item never holds back the others'
    results. Items go where the `routing` says (`Routing`: a node, or the GPU lane).

    `shared` values are put in the object store once (a `Shared` one is already there, and
    each worker process deserializes it once, whatever the map). A worker's `RamDistError`
    (a `StorageError` naming the file it could not read or write, among others) is raised
    again here as itself, and a store's failure no layer named as a `StorageError`, so the
    user sees one line rather than a Ray traceback; the task's traceback is logged at debug
    level.
    """
    tasks = TaskLane(resources, max_in_flight)
    shared_refs = tuple(v if isinstance(v, Shared) else ray.put(v) for v in shared)
    pending: dict[ray.ObjectRef, _Group] = {}
    groups = routing.groups(items, tasks)
    held: _Group | None = None  # the next group, waiting for room
    try:
        while True:
            while True:
                if held is None:
                    held = next(groups, None)
                    if held is None:
                        break
                if not held.lane.has_room(held.place):
                    break
                if len(held.items) == 1:
                    ref = held.lane.submit(fn, held.items[0], shared_refs, held.place)
                else:
                    batch = functools.partial(_each, fn)
                    ref = held.lane.submit(batch, tuple(held.items), shared_refs, held.place)
                pending[ref] = held
                held = None
            if not pending:
                assert held is None, "a lane with nothing in flight took no item"
                return
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                group = pending.pop(ref)
                node, result = group.lane.result(ref)
                values = [result] if len(group.items) == 1 else map(pickle.loads, result)
                for item, value in zip(group.items, values, strict=True):
                    yield item, node, value
    finally:
        for ref, group in pending.items():
            group.lane.forget(ref)
        _drop(list(pending))


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


def get_result(ref: ray.ObjectRef) -> Any:
    """`ray.get(ref)`, a worker's `RamDistError` raised as itself and a store's failure as a
    `StorageError`."""
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


def near(node_id: str | None, only: bool = False) -> Place | None:
    """Run at `node_id` while that node lives (else anywhere), or, with `only`, there and
    nowhere else."""
    return None if node_id is None else Place(node_id, only)


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
