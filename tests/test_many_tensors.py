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

