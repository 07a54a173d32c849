"""The passes' timeline in merge_report.json (engine/timeline.py): the gaps between a worker's
tasks, worked out by hand; and a real merge on a real local Ray, whose timeline adds up
(per worker and in total, against the pass's wall time), counts the pass's units and tasks,
and shows the reads, hashes and writes it made; the passes read in turn backwards and
forwards. No assertion about speed.
"""

from __future__ import annotations

import pytest
import torch
from builders import build_model_set, load_checkpoint, merge_config
from reference import reference_merge

from ram_dist.api import run_merge
from ram_dist.engine.timeline import PHASES, PassTimeline, TaskTimes
from ram_dist.report.text import format_merge, timeline_line

#: Rounding of the report's seconds (4 places), summed over a few fields.
ROUNDING = 1e-3


def _task(started: float, ended: float, units: int = 1, **phases: float) -> TaskTimes:
    return TaskTimes(started, ended, units, {p: phases.get(p, 0.0) for p in PHASES})


def test_gaps_between_tasks_are_idle_and_the_ends_are_counted_apart():
    line = PassTimeline(started=100.0, ended=110.0)
    line.add("h:1", "n", _task(101.0, 103.0, 2, read_s=1.5, compute_s=1.0, read_wait_s=0.5))
    line.add("h:1", "n", _task(104.5, 109.0, 1, compute_s=4.0, write_s=3.0, write_wait_s=0.25))
    line.add("h:2", "n", _task(100.0, 110.0, 3, compute_s=9.0))
    line.add("h:2", "n", None)  # a result without a clock (an older worker) is left out
    got = line.as_dict()
    assert got["wall_s"] == 10.0
    one, two = got["workers"]
    assert (one["worker"], one["units"], one["tasks"]) == ("h:1", 3, 2)
    assert (one["busy_s"], one["idle_s"]) == (6.5, 1.5)
    assert (one["before_first_s"], one["after_last_s"]) == (1.0, 1.0)
    assert (one["read_s"], one["compute_s"], one["write_s"]) == (1.5, 5.0, 3.0)
    assert one["other_s"] == 6.5 - 0.5 - 5.0 - 0.25
    assert (two["busy_s"], two["idle_s"], two["before_first_s"], two["after_last_s"]) == (
        10.0, 0.0, 0.0, 0.0,
    )  # fmt: skip
    total = got["total"]
    assert (total["workers"], total["units"], total["tasks"]) == (2, 6, 3)
    assert total["busy_s"] == 16.5 and total["busy_share"] == 16.5 / 20
    assert total["idle_s"] == 1.5 and total["compute_s"] == 14.0


def test_a_pass_without_tasks_has_no_workers():
    line = PassTimeline(started=5.0, ended=5.5)
    got = line.as_dict()
    assert got["workers"] == [] and got["total"]["workers"] == 0
    assert got["total"]["busy_share"] is None


@pytest.fixture(scope="module")
def merged(ray_local, tmp_path_factory) -> dict:
    """A RAM+ merge of a small model in several units per pass, and what it should hold."""
    root = tmp_path_factory.mktemp("timeline")
    base_dir, task_dirs, base, tasks = build_model_set(root, base_shard="100KB", task_shard=70_000)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    out = root / "out"
    report = run_merge(
        merge_config(base_dir, task_dirs, out, method="ram_plus", unit_budget_bytes=16_384)
    ).data
    return {"report": report, "out": out, "expected": expected}


def _close(a: float, b: float, slack: float = ROUNDING) -> bool:
    return abs(a - b) <= slack


@pytest.mark.parametrize("name", ["reduce", "map"])
def test_each_workers_time_adds_up_to_the_pass(merged, name):
    stats = merged["report"]["passes"][name]
    line = stats["timeline"]
    assert line["wall_s"] > 0 and _close(line["wall_s"], stats["wall_s"], 0.05)
    rows, total = line["workers"], line["total"]
    assert total["workers"] == len(rows) == stats["worker_processes"] >= 1
    assert sum(r["units"] for r in rows) == total["units"] == stats["units"] > len(rows)
    assert sum(r["tasks"] for r in rows) == total["tasks"] == stats["tasks"]
    for row in rows:
        assert row["node"] in stats["units_per_node"]
        assert all(row[k] >= 0 for k in row if k.endswith("_s"))
        in_thread = row["read_wait_s"] + row["compute_s"] + row["write_wait_s"]
        assert in_thread <= row["busy_s"] + ROUNDING
        assert _close(in_thread + row["other_s"], row["busy_s"])
        around = row["busy_s"] + row["idle_s"] + row["before_first_s"] + row["after_last_s"]
        assert _close(around, line["wall_s"], 4 * ROUNDING)
        assert row["compute_s"] > 0 and row["read_s"] > 0
    for key in ("busy_s", "idle_s", "read_s", "compute_s", "write_s"):
        assert _close(total[key], sum(r[key] for r in rows))
    assert 0 < total["busy_share"] <= 1
    assert total["busy_s"] <= line["wall_s"] * total["workers"] + ROUNDING


def test_reduce_neither_hashes_nor_writes_and_map_does_both(merged):
    passes = merged["report"]["passes"]
    reduce, map_ = passes["reduce"]["timeline"]["total"], passes["map"]["timeline"]["total"]
    assert reduce["hash_s"] == reduce["write_s"] == reduce["write_wait_s"] == 0
    assert map_["hash_s"] > 0 and map_["write_s"] > 0
    assert passes["map"]["bytes_written_by_workers"] > 0
    written = load_checkpoint(merged["out"])
    assert all(torch.equal(written[k], v) for k, v in merged["expected"].items())


def test_the_text_report_has_a_line_per_pass(merged):
    report = merged["report"]
    text = format_merge(report, str(merged["out"]))
    for name in ("reduce", "map"):
        line = timeline_line(report["passes"][name]["timeline"])
        assert f"{name} time: {line}" in text
        workers = report["passes"][name]["timeline"]["total"]["workers"]
        assert line.startswith(f"{workers} worker(s) computing ")


def test_the_first_pass_reads_backwards_and_the_next_forwards(merged):
    passes = merged["report"]["passes"]
    assert passes["reduce"]["backward"] is True
    assert passes["map"]["backward"] is False
