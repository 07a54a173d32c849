"""The pool's Ray tasks, on a real local Ray: what a worker prints when a task is cancelled;
how small items travel together, several to a Ray task (`Batching`)."""

from __future__ import annotations

import pytest

from ram_dist.engine.pool import Batching, Routing, near, unordered_map
from ram_dist.errors import RamDistError


def test_a_cancelled_tasks_interrupt_in_a_finalizer_prints_nothing(ray_local):
    """The `KeyboardInterrupt` that stops a cancelled task says nothing on the worker's
    stderr (Ray would relay it under the job's one-line error); any other exception a
    finalizer raises is still printed by Python's own hook."""

    def _unraisable_from_a_finalizer(kind: type[BaseException]) -> str:
        """Raise `kind` in a weakref callback, where `ray.cancel`'s `KeyboardInterrupt` may
        land, and give back what Python printed for it (local: Ray sends it by value)."""
        import contextlib
        import io
        import weakref

        class Thing:
            pass

        def callback(_ref: object) -> None:
            raise kind("raised in a finalizer")

        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            thing = Thing()
            ref = weakref.ref(thing, callback)
            del thing
        assert ref() is None
        return printed.getvalue()

    kinds = [KeyboardInterrupt, ValueError]
    printed = {
        item: text
        for item, _, text in unordered_map(
            _unraisable_from_a_finalizer, kinds, (), max_in_flight=2, resources={"num_cpus": 1}
        )
    }
    assert printed[KeyboardInterrupt] == ""
    assert "Exception ignored" in printed[ValueError], printed
    assert "ValueError: raised in a finalizer" in printed[ValueError], printed


def test_small_items_bound_for_one_place_travel_together_up_to_the_weight():
    """`Routing.groups`, pure: consecutive items for the task lane at one place make a group
    until their weight reaches `least`; a GPU lane's item, or another place, ends one."""
    tasks, gpu = object(), _Gpu()
    heavy, on_gpu = {2: 5}, {12}
    routing = Routing(
        place_of=lambda i: None if i < 8 else near("node-b"),
        gpu=gpu,  # type: ignore[arg-type]
        on_gpu=lambda i: i in on_gpu,
        batching=Batching(weight=lambda i: heavy.get(i, 1), least=3),
    )
    groups = [(g.items, g.lane) for g in routing.groups(range(15), tasks)]  # type: ignore[arg-type]
    assert groups == [
        ([0, 1, 2], tasks),  # item 2 alone weighs 5: the group is full with it
        ([3, 4, 5], tasks),
        ([6, 7], tasks),  # item 8 goes to another node
        ([8, 9, 10], tasks),
        ([11], tasks),  # item 12 goes to the GPU lane, alone
        ([12], gpu),
        ([13, 14], tasks),
    ]
    unbatched = Routing(place_of=lambda i: None)
    assert [g.items for g in unbatched.groups(range(3), tasks)] == [[0], [1], [2]]  # type: ignore[arg-type]


class _Gpu:
    def serves(self, place: object) -> bool:
        return True


def test_a_batch_is_one_ray_task_whose_items_come_back_one_by_one(ray_local):
    """On Ray: twelve items of weight 1, batched to 4, run as three Ray tasks of four
    consecutive items each, every item's own result yielded with it; an item's
    `RamDistError` in a batch is raised as itself."""

    def _task_id(item: int, offset: int) -> tuple[int, str]:  # nested: pickled by value
        import ray

        if item == 99:
            raise RamDistError("item 99 is bad")
        return item + offset, ray.get_runtime_context().get_task_id()

    routing = Routing(batching=Batching(weight=lambda i: 1, least=4))
    got = {
        item: value
        for item, _, value in unordered_map(
            _task_id, range(12), (100,), 2, {"num_cpus": 1}, routing
        )
    }
    assert sorted(got) == list(range(12))
    assert all(got[i][0] == i + 100 for i in got)
    task_of = [got[i][1] for i in range(12)]
    assert len(set(task_of)) == 3
    assert all(task_of[i] == task_of[i - i % 4] for i in range(12))
    with pytest.raises(RamDistError, match="item 99 is bad"):
        list(unordered_map(_task_id, [1, 99, 2], (0,), 2, {"num_cpus": 1}, routing))


def test_a_batch_s_results_are_their_own_when_the_worker_reuses_a_buffer(ray_local):
    """Each item's result leaves the task as it was when the item ended, though it is a
    buffer the next item of the batch overwrites (a through-driver part's bytes are the
    worker's reused output buffer)."""
    import numpy as np

    held: dict[str, np.ndarray] = {}  # one per task: the closure is unpickled once a task

    def _fill(item: int) -> np.ndarray:  # nested: pickled by value, `held` with it
        buffer = held.setdefault("buffer", np.zeros(4, dtype=np.int64))
        buffer[:] = item
        return buffer

    routing = Routing(batching=Batching(weight=lambda i: 1, least=4))
    got = {item: value for item, _, value in unordered_map(_fill, range(8), (), 2, {}, routing)}
    assert {item: value.tolist() for item, value in got.items()} == {i: [i] * 4 for i in range(8)}
