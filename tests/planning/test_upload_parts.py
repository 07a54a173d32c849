"""The part planner: runs of units that a multipart upload takes (S3's limits), in order."""

from __future__ import annotations

import pytest

from ram_dist.planning.units import (
    MAX_PARTS,
    MIN_PART_BYTES,
    Piece,
    TensorSlot,
    WorkUnit,
    parts_as_recorded,
    plan_parts,
    plan_units,
)

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _units(shard_sizes: dict[str, list[int]]) -> tuple[list[WorkUnit], dict[int, int]]:
    units, sizes = [], {}
    for shard, unit_sizes in shard_sizes.items():
        for size in unit_sizes:
            index = len(units)
            units.append(WorkUnit(index, shard, (Piece(f"t{index}", 0, size),)))
            sizes[index] = size
    return units, sizes


def _check(parts, units, sizes, headers, min_part, max_parts):
    """Parts tile each shard from byte 0 (the header in part 1), in unit order, within the
    limits: every part but a shard's last at least `min_part`, at most `max_parts`."""
    by_shard: dict[str, list] = {}
    for part in parts:
        by_shard.setdefault(part.shard, []).append(part)
    assert list(by_shard) == list(headers)
    for shard, shard_parts in by_shard.items():
        assert [p.number for p in shard_parts] == list(range(1, len(shard_parts) + 1))
        assert len(shard_parts) <= max_parts
        assert shard_parts[0].start == 0
        expected = [u.index for u in units if u.shard == shard]
        assert [i for p in shard_parts for i in p.units] == expected
        for a, b in zip(shard_parts, shard_parts[1:], strict=False):
            assert a.stop == b.start
        for p in shard_parts:
            header = headers[shard] if p.number == 1 else 0
            assert p.size == header + sum(sizes[i] for i in p.units)
        for p in shard_parts[:-1]:
            assert p.size >= min_part
        assert shard_parts[-1].stop == headers[shard] + sum(sizes[i] for i in expected)


def test_small_units_are_grouped_into_parts_of_at_least_5_mib():
    units, sizes = _units({"a": [1 << 20] * 23, "b": [300_000] * 40})
    headers = {"a": 1000, "b": 200}
    parts = plan_parts(units, sizes, headers)
    _check(parts, units, sizes, headers, MIN_PART_BYTES, MAX_PARTS)
    a = [p for p in parts if p.shard == "a"]
    assert [len(p.units) for p in a] == [5, 5, 5, 5, 3] and a[-1].size < MIN_PART_BYTES
    assert [len(p.units) for p in parts if p.shard == "b"] == [18, 18, 4]


def test_a_shard_with_more_units_than_parts_allowed():
    units, sizes = _units({"big": [6 << 20] * 250})
    parts = plan_parts(units, sizes, {"big": 512}, max_parts=100)
    _check(parts, units, sizes, {"big": 512}, MIN_PART_BYTES, 100)
    assert len(parts) == 84  # each part at least 1/100 of the shard: 3 units of 6 MiB


def test_more_than_ten_thousand_units_fit_in_ten_thousand_parts():
    units, sizes = _units({"huge": [6 << 20] * 12_345})
    parts = plan_parts(units, sizes, {"huge": 4096})
    _check(parts, units, sizes, {"huge": 4096}, MIN_PART_BYTES, MAX_PARTS)
    assert MAX_PARTS // 2 <= len(parts) <= MAX_PARTS


def test_a_shard_that_is_one_small_tensor_is_one_part():
    units, sizes = _units({"tiny": [6]})
    parts = plan_parts(units, sizes, {"tiny": 88})
    assert [(p.number, p.units, p.start, p.stop) for p in parts] == [(1, (0,), 0, 94)]


def test_empty_tensors_at_the_end_join_the_last_part_and_a_shard_without_units_is_a_header():
    units, sizes = _units({"a": [6 << 20, 6 << 20, 0, 0], "none": []})
    parts = plan_parts(units, sizes, {"a": 64, "none": 24})
    _check(parts, units, sizes, {"a": 64, "none": 24}, MIN_PART_BYTES, MAX_PARTS)
    assert [p.units for p in parts] == [(0,), (1, 2, 3), ()]
    assert (parts[-1].start, parts[-1].stop) == (0, 24)


@pytest.mark.parametrize("min_part", [0, 1, 100, 10_000])
@pytest.mark.parametrize("max_parts", [1, 3, 10_000])
def test_limits_hold_for_any_mix(min_part, max_parts):
    units, sizes = _units({"x": [7, 0, 300, 5000, 1, 1, 20_000, 3], "y": [10**6], "z": [0, 5]})
    headers = {"x": 16, "y": 8, "z": 8}
    parts = plan_parts(units, sizes, headers, min_part, max_parts)
    _check(parts, units, sizes, headers, min_part, max_parts)
    for shard in headers:  # no part is larger than it must be
        shard_parts = [p for p in parts if p.shard == shard]
        target = max(min_part, -(-shard_parts[-1].stop // max_parts), 1)
        for p in shard_parts[:-1]:
            assert len(p.units) == 1 or p.size - sizes[p.units[-1]] < target


SLOTS = [
    TensorSlot("embed", "s", numel=256 * 64, row=64, max_itemsize=2),
    TensorSlot("norm", "s", numel=64, row=1, max_itemsize=4),
    TensorSlot("empty", "s", numel=0, row=1, max_itemsize=2),
    TensorSlot("wide", "s", numel=3 * 1000, row=1000, max_itemsize=4),
]
OUT_ITEMSIZE = {"embed": 2, "norm": 4, "empty": 2, "wide": 2}  # e.g. bf16 out for "wide"


def _elements(units) -> list[tuple[str, int]]:
    """Every (tensor, element) the units cover, in order."""
    return [(p.tensor, i) for u in units for p in u.pieces for i in range(p.start, p.stop)]


@pytest.mark.parametrize("was", [3000, 10_000, 40_000])
@pytest.mark.parametrize("now", [200, 4096, 10**9])
def test_a_resumed_shard_keeps_its_recorded_parts_whatever_the_budget(was, now):
    def planned(budget):
        units = plan_units(SLOTS, budget)
        sizes = {u.index: sum(p.numel * OUT_ITEMSIZE[p.tensor] for p in u.pieces) for u in units}
        return units, plan_parts(units, sizes, {"s": 120}, min_part_bytes=5000)

    _, recorded = planned(was)
    units, _ = planned(now)
    ranges = [[p.start, p.stop] for p in recorded]
    got = parts_as_recorded("s", units, OUT_ITEMSIZE, 120, ranges, next_index=len(units))
    assert got is not None
    parts, cut = got
    assert [[p.start, p.stop] for p in parts] == ranges
    assert _elements(cut) == _elements(units)  # the same elements, in the same order
    assert len({u.index for u in cut}) == len(cut)
    by_index = {u.index: u for u in cut}
    for p in parts:
        made = sum(q.numel * OUT_ITEMSIZE[q.tensor] for i in p.units for q in by_index[i].pieces)
        assert made + (120 if p.number == 1 else 0) == p.size


def test_recorded_ranges_that_do_not_fit_are_refused():
    units = plan_units(SLOTS, 4096)
    total = 120 + sum(p.numel * OUT_ITEMSIZE[p.tensor] for u in units for p in u.pieces)
    ok = [[0, 1000], [1000, total]]
    assert parts_as_recorded("s", units, OUT_ITEMSIZE, 120, ok, len(units)) is not None
    for bad in ([[0, 1001], [1001, total]],  # inside a 2-byte element
                [[0, 1000], [1000, total - 2]],  # does not reach the end
                [[0, 100], [100, total]],  # part 1 shorter than the header
                [[0, 1000], [999, total]]):  # fmt: skip
        assert parts_as_recorded("s", units, OUT_ITEMSIZE, 120, bad, len(units)) is None


def test_a_recorded_part_may_end_only_between_bands_of_an_fp8_weight():
    """An FP8 weight of 3 bands of 40 elements (1 byte each): a resumed run may cut its units
    at a recorded part's end only where a band ends."""
    slots = [TensorSlot("w", "s", numel=120, row=40, max_itemsize=1, atomic=True)]
    units = plan_units(slots, 10**6)
    rows = {"w": 40}
    total = 10 + 120
    at_band = [[0, 10 + 40], [10 + 40, total]]
    got = parts_as_recorded("s", units, {"w": 1}, 10, at_band, len(units), rows)
    assert got is not None and [[p.start, p.stop] for p in got[0]] == at_band
    inside = [[0, 10 + 41], [10 + 41, total]]
    assert parts_as_recorded("s", units, {"w": 1}, 10, inside, len(units), rows) is None
    assert parts_as_recorded("s", units, {"w": 1}, 10, inside, len(units)) is not None
