"""The garbage collector's one home (`engine.collector`): paused, frozen, settled, and the
callers that use it."""

from __future__ import annotations

import gc
import threading

import pytest

from ram_dist.engine import collector
from ram_dist.errors import RamDistError


def test_paused_turns_the_collector_off_and_back_as_it_was():
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RamDistError), collector.paused():
        raise RamDistError("a check failed")
    assert gc.isenabled()
    gc.disable()  # a caller that keeps it off keeps it off
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_in_two_threads_end_with_the_last():
    """A GPU worker's two threads: the first to finish does not turn it back on under the
    second."""
    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector.paused():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with collector.paused():
        thread.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still on
    leave.set()
    thread.join()
    assert gc.isenabled()


def test_frozen_leaves_objects_alone_for_the_block_only():
    before = gc.get_freeze_count()
    kept = [[] for _ in range(1000)]
    with collector.frozen():
        assert gc.get_freeze_count() >= before + len(kept)
    assert gc.get_freeze_count() == 0
    del kept


def test_settled_builds_with_the_collector_off_and_keeps_the_value_frozen():
    seen = []
    try:
        value = collector.settled(lambda: seen.append(gc.isenabled()) or [object()])
        assert seen == [False]
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
        assert isinstance(value, list)
    finally:
        gc.unfreeze()


def test_the_driver_plans_with_the_collector_paused(monkeypatch):
    from ram_dist.engine import driver

    seen = []
    monkeypatch.setattr(driver.planning, "prepare", lambda config: seen.append(gc.isenabled()))
    driver.prepare(None)  # type: ignore[arg-type]
    assert seen == [False]
    assert gc.isenabled()


def test_no_module_but_the_collector_controls_it():
    """The collector's policy has one home: no other module of the package turns it off, on,
    or freezes objects."""
    import ast
    from pathlib import Path

    package = Path(collector.__file__).resolve().parents[1]
    calls = {"disable", "enable", "collect", "freeze", "unfreeze"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(collector.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "gc"
                and node.attr in calls
            ):
                found.append(f"{path.relative_to(package)}: gc.{node.attr}")
    assert found == []
