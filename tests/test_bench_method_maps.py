"""`benchmarks.bench_method_maps` on a tiny tensor: every registry method's reduce rounds and
map pass run fused and eager, with the same statistics and bytes, each beside the copy."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_method_maps as bmm
from ram_dist.methods.registry import METHODS


@pytest.fixture(scope="module")
def rows() -> list[bmm.Row]:
    return bmm.bench((16, 128), torch.bfloat16, 1, bmm.cases(), eager=True)


def test_every_method_and_variant_has_its_map_pass(rows) -> None:
    mapped = [r.case for r in rows if r.what == "map"]
    assert sorted(mapped) == sorted([*METHODS, *(label for label, _, _ in bmm.VARIANTS)])


def test_the_fused_and_eager_passes_agree_and_stand_beside_the_copy(rows) -> None:
    assert [r for r in rows if not r.identical] == []
    assert all(r.eager_s is not None and r.memcpy_s > 0 and r.fused_s > 0 for r in rows)


def test_each_round_the_method_runs_is_timed(rows) -> None:
    rounds = {}
    for r in rows:
        if r.what != "map":
            rounds[r.case] = rounds.get(r.case, 0) + 1
    assert rounds["ties"] == METHODS["ties"].rounds and "task_arithmetic" not in rounds
    assert rounds["della"] == 1 and rounds["sce"] == METHODS["sce"].rounds


def test_fused_only_times_no_eager_pass_and_still_compares(capsys) -> None:
    bmm.main(["--rows", "8", "--cols", "64", "--repeats", "1", "--method", "della",
              "--fused-only"])  # fmt: skip
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("della")]
    assert [ln.split()[:3] for ln in lines] == [["della:", "round", "1"], ["della:", "map", "-"]]
    assert all(ln.endswith("True") for ln in lines)
