"""A task starts a thread only where it has work to overlap: a unit read in one call reads in
the computing thread, and a part handed off only at its end (under `HAND_OFF_BYTES`) is
hashed there. With read-ahead and hand-offs forced, the threads start, and the bytes are the
same either way. The passes run inline (`support/inline_passes.py`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from builders import build_model_set
from inline_passes import merge_inline

from ram_dist.engine import blocks, map_step

pytestmark = pytest.mark.quick


class _Counted(ThreadPoolExecutor):
    """A real executor that counts how many were made, by thread name prefix."""

    made: list[str] = []

    def __init__(self, *args, thread_name_prefix: str = "", **kw) -> None:
        _Counted.made.append(thread_name_prefix)
        super().__init__(*args, thread_name_prefix=thread_name_prefix, **kw)


@pytest.fixture
def counted(monkeypatch) -> list[str]:
    _Counted.made = []
    monkeypatch.setattr(blocks, "ThreadPoolExecutor", _Counted)
    monkeypatch.setattr(map_step, "ThreadPoolExecutor", _Counted)
    return _Counted.made


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base_dir, task_dirs, _, _ = build_model_set(tmp_path_factory.mktemp("models"), seed=3)
    return base_dir, task_dirs


def test_small_units_and_parts_start_no_thread(models, counted, monkeypatch):
    base_dir, task_dirs = models
    quiet = merge_inline(base_dir, task_dirs, "ties", parameters={"density": 0.5})
    assert quiet and counted == []
    # every block a group of its own, and every block handed off: both threads start
    monkeypatch.setattr(blocks, "GROUP_BLOCKS", 1)
    monkeypatch.setattr(map_step, "HAND_OFF_BYTES", 1)
    threaded = merge_inline(
        base_dir, task_dirs, "ties", parameters={"density": 0.5}, unit_budget_bytes=1 << 20
    )
    assert "ram-dist-read" in counted and "ram-dist-sha256" in counted
    assert threaded == quiet
