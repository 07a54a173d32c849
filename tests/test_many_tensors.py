"""Checkpoints of many small tensors (MoE norms, routers, scales): what a unit holds."""

from __future__ import annotations

import pytest

from ram_dist.units import TensorSlot, plan_units


@pytest.mark.parametrize("max_pieces", [1, 3, 1000])
def test_units_hold_at_most_max_pieces(max_pieces):
    slots = [TensorSlot(f"t{i}", f"s{i // 700}", numel=1 + i % 5, row=1, max_itemsize=2)
             for i in range(2000)]  # fmt: skip
    units = plan_units(slots, 10**9, max_pieces)
    assert all(0 < len(u.pieces) <= max_pieces for u in units)
    assert [p.tensor for u in units for p in u.pieces] == [s.name for s in slots]
    per_shard = [700, 700, 600]
    assert len(units) == sum(-(-n // max_pieces) for n in per_shard)
    assert [u.index for u in units] == list(range(len(units)))


@pytest.mark.usefixtures("ray_local")
def test_a_shared_value_is_deserialized_once_per_worker_process():
    """`pool.Shared`: what every task takes (the layout, the parameters) crosses to each
    worker process once, whatever the number of tasks and maps."""
    import os

    from ram_dist.engine.pool import Shared, unordered_map

    shared = Shared({f"t{i}": {"epsilon": 1e-5, "r": 0.1} for i in range(1000)})

    def where(item: int, value: dict) -> tuple[int, int, int]:
        value["tasks"] = value.get("tasks", 0) + 1  # seen by the next task of this process
        return os.getpid(), value["tasks"], len(value)

    tasks: dict[int, int] = {}
    for _ in range(2):
        for _, _, (pid, count, size) in unordered_map(where, range(8), (shared,), 2, {}):
            assert size == 1001
            tasks[pid] = max(tasks.get(pid, 0), count)
    assert sum(tasks.values()) == 16  # each process counted every task it ran
