"""The pool's Ray tasks, on a real local Ray: what a worker prints when a task is cancelled."""

from __future__ import annotations

from ram_dist.engine.pool import unordered_map


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
