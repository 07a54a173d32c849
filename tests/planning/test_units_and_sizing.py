"""The planner: units cover every element once, in order, within the per-input budget."""

from __future__ import annotations

import pytest

from ram_dist.errors import RamDistError
from ram_dist.planning.units import TensorSlot, plan_units

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

SLOTS = [
    TensorSlot("embed", "a.safetensors", numel=256 * 64, row=64, max_itemsize=2),
    TensorSlot("norm", "a.safetensors", numel=64, row=1, max_itemsize=4),
    TensorSlot("scalar", "a.safetensors", numel=1, row=1, max_itemsize=2),
    TensorSlot("empty", "b.safetensors", numel=0, row=1, max_itemsize=2),
    TensorSlot("wide", "b.safetensors", numel=3 * 1000, row=1000, max_itemsize=4),
]


@pytest.mark.parametrize("budget", [4, 100, 128, 1000, 4000, 4096, 10_000, 10**9])
def test_units_cover_each_element_once_within_budget(budget):
    units = plan_units(SLOTS, budget)
    covered: dict[str, list[tuple[int, int]]] = {}
    itemsize = {s.name: s.max_itemsize for s in SLOTS}
    for k, unit in enumerate(units):
        assert unit.index == k
        assert sum(p.numel * itemsize[p.tensor] for p in unit.pieces) <= budget
        for p in unit.pieces:
            covered.setdefault(p.tensor, []).append((p.start, p.stop))
    order = [p.tensor for u in units for p in u.pieces]
    assert list(dict.fromkeys(order)) == [s.name for s in SLOTS]
    for s in SLOTS:
        ranges = covered[s.name]
        assert ranges[0][0] == 0 and ranges[-1][1] == s.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_whole_rows_when_a_row_fits_and_shards_never_mix():
    units = plan_units(SLOTS, 64 * 2 * 3 + 10)  # three embed rows and a bit
    for unit in units:
        for p in unit.pieces:
            if p.tensor == "embed":
                assert p.start % 64 == 0 and (p.stop % 64 == 0 or p.stop == 256 * 64)
    assert {u.shard for u in units} == {"a.safetensors", "b.safetensors"}
    assert all(
        {SLOTS[[s.name for s in SLOTS].index(p.tensor)].shard for p in u.pieces} == {u.shard}
        for u in units
    )


def test_small_tensors_are_packed_together():
    units = plan_units(SLOTS, 10**9)
    assert len(units) == 2  # one per shard


def test_budget_below_one_element_is_refused():
    with pytest.raises(RamDistError, match="cannot hold one element"):
        plan_units(SLOTS, 3)


def test_default_budget_from_cores_and_memory():
    """8 units per core over the largest input, 1/8 of a core's memory, 16 to 256 MiB,
    whole MiB."""
    from ram_dist.planning.sizing import MIB, auto_unit_budget

    # 0.5B bf16 params (940 MiB per input) on 2 cores and 24 GiB: ceil(940 MiB / 16)
    assert auto_unit_budget(940 * MIB, 2, 24 * 1024 * MIB) == 58 * MIB
    # 70B bf16 (140 GB per input) on 128 cores with 8 GiB each: 1024 units
    assert auto_unit_budget(140 * 10**9, 128, 128 * 8 * 1024 * MIB) == 130 * MIB
    # few cores and much memory: the 256 MiB cap
    assert auto_unit_budget(10**12, 4, 64 * 1024 * MIB) == 256 * MIB
    # memory-bound: 1 GiB per core allows 128 MiB
    assert auto_unit_budget(10**12, 8, 8 * 1024 * MIB) == 128 * MIB
    # a tiny model still gets the 16 MiB floor
    assert auto_unit_budget(10**6, 2, 24 * 1024 * MIB) == 16 * MIB


def test_atomic_rows_are_never_cut_and_one_goes_over_a_small_budget():
    """An FP8 weight's bands (4 rows of 10 here): units hold whole bands, at least one even
    when a band is over the budget; a scale tensor that follows its whole weight in a unit
    costs nothing there, elsewhere its blocks' bytes."""
    weight = TensorSlot("w", "s", numel=90, row=40, max_itemsize=1, atomic=True)
    scales = TensorSlot("w_scale_inv", "s", numel=3, row=1, max_itemsize=40, atomic=True,
                        follows="w")  # fmt: skip
    units = plan_units([weight, scales], budget_bytes=30)
    cuts = [(p.tensor, p.start, p.stop) for u in units for p in u.pieces]
    assert cuts == [("w", 0, 40), ("w", 40, 80), ("w", 80, 90), ("w_scale_inv", 0, 1),
                    ("w_scale_inv", 1, 2), ("w_scale_inv", 2, 3)]  # fmt: skip
    whole = plan_units([weight, scales], budget_bytes=100)
    assert [[(p.tensor, p.start, p.stop) for p in u.pieces] for u in whole] == [
        [("w", 0, 90), ("w_scale_inv", 0, 3)]
    ]


def test_an_fp8_weight_that_fits_a_unit_starts_one_rather_than_be_cut():
    small = TensorSlot("norm", "s", numel=60, row=1, max_itemsize=1)
    weight = TensorSlot("w", "s", numel=80, row=40, max_itemsize=1, atomic=True)
    scales = TensorSlot("w_scale_inv", "s", numel=2, row=1, max_itemsize=40, atomic=True,
                        follows="w")  # fmt: skip
    units = plan_units([small, weight, scales], budget_bytes=100)
    assert [[(p.tensor, p.start, p.stop) for p in u.pieces] for u in units] == [
        [("norm", 0, 60)],
        [("w", 0, 80), ("w_scale_inv", 0, 2)],
    ]
