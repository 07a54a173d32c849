"""The probe's figures, per-layer table and Markdown summary: made from the report's numbers.

Every number is checked against values computed by hand from a hand-written report, in the
data, in the plotted artists (bar heights, the heatmap's array) and in the written files.
"""

from __future__ import annotations

import copy
import csv
import io
import subprocess
import sys

import pytest
from hand_report import HAND_HIST, hand_report, png_size

from ram_dist.report import figures

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def test_figure2_data_is_the_hand_computed_numbers() -> None:
    data = figures.figure2_data(hand_report())
    assert data["density"] == [0.04, 0.5, 0.22]
    assert data["changed"] == [40, 500, 220]
    assert data["others"] == [0, 1, 2]
    assert data["counts"] == HAND_HIST
    assert data["shares"][0] == [0.25, 0.5, 0.25]
    assert data["shares"][1] == [0.5, 0.48, 0.02]
    assert data["shares"][2] == pytest.approx([5 / 11, 1 / 2, 1 / 22], rel=0, abs=1e-15)
    assert data["labels"] == ["1: agent1", "2: agent2", "3: agent3"]
    assert data["models"] == ["/data/agents/agent1", "/data/agents/agent2", "/data/agents/agent3"]


def test_figure2_bars_carry_the_report_numbers() -> None:
    report = hand_report()
    fig = figures.figure2(report)
    left, right = fig.axes[:2]
    assert [b.get_height() for b in left.containers[0]] == pytest.approx([4.0, 50.0, 22.0])

    labels = ["unique (0 others)", "with 1 other", "with 2 others"]
    assert [c.get_label() for c in right.containers] == labels
    shares = figures.figure2_data(report)["shares"]
    for t in range(3):
        heights = [c[t].get_height() for c in right.containers]
        bottoms = [c[t].get_y() for c in right.containers]
        assert heights == pytest.approx([100 * s for s in shares[t]])
        assert bottoms == pytest.approx([0.0, 100 * shares[t][0], 100 * sum(shares[t][:2])])
        assert sum(heights) == pytest.approx(100.0)
    assert [t.get_text() for t in left.get_xticklabels()] == ["1: agent1", "2: agent2", "3: agent3"]


def test_write_figure2_is_a_1000x400_png(tmp_path) -> None:
    from matplotlib.image import imread

    path = tmp_path / "figure2.png"
    figures.write_figure2(hand_report(), path)
    assert png_size(path.read_bytes()) == (1000, 400)
    assert imread(path).shape[:2] == (400, 1000)
    buffer = io.BytesIO()  # a file object works too
    figures.write_figure2(hand_report(), buffer)
    assert png_size(buffer.getvalue()) == (1000, 400)


def test_image_sizes_do_not_depend_on_the_number_of_tasks_or_layers(tmp_path) -> None:
    n, layers = 7, 80
    hist = [10] * n
    report = hand_report()
    report["tasks"] = [
        {**report["tasks"][0], "histogram": hist, "changed": 10 * n, "model": f"s3://b/agent{i}"}
        for i in range(n)
    ]
    report["layers"] = [
        {
            "layer": f"model.layers.{i}",
            "tasks": [{"changed": i, "unique": 0, "shared": i, "participating": 100}] * n,
        }
        for i in range(layers)
    ]
    figures.write_figure2(report, tmp_path / "f.png")
    figures.write_layer_heatmap(report, tmp_path / "h.png")
    assert png_size((tmp_path / "f.png").read_bytes()) == (1000, 400)
    assert png_size((tmp_path / "h.png").read_bytes()) == (800, 600)


def test_a_task_that_changed_nothing_has_empty_shares() -> None:
    report = hand_report()
    report["tasks"][2] |= {"changed": 0, "unique": 0, "shared": 0, "histogram": [0, 0, 0]}
    data = figures.figure2_data(report)
    assert data["shares"][2] == [0.0, 0.0, 0.0]


def test_figure2_refuses_reports_without_consistent_task_statistics() -> None:
    baseline = {k: v for k, v in hand_report().items() if k not in ("tasks", "elements")}
    baseline["method"] = "ties"
    with pytest.raises(ValueError, match="no per-task statistics"):
        figures.figure2_data(baseline)
    broken = hand_report()
    broken["tasks"][1]["histogram"] = [250, 240]
    with pytest.raises(ValueError, match="task 2: histogram"):
        figures.figure2_data(broken)


EXPECTED_LAYER_ROWS = [
    ("model.layers.0", 1, 20, 5, 15, 400, 20 / 400, 5 / 20),
    ("model.layers.0", 2, 200, 100, 100, 400, 200 / 400, 100 / 200),
    ("model.layers.0", 3, 0, 0, 0, 400, 0.0, None),
    ("model.layers.1", 1, 10, 5, 5, 400, 10 / 400, 5 / 10),
    ("model.layers.1", 2, 200, 100, 100, 400, 200 / 400, 100 / 200),
    ("model.layers.1", 3, 100, 25, 75, 400, 100 / 400, 25 / 100),
    ("other", 1, 10, 0, 10, 200, 10 / 200, 0.0),
    ("other", 2, 100, 50, 50, 200, 100 / 200, 50 / 100),
    ("other", 3, 120, 75, 45, 200, 120 / 200, 75 / 120),
]


def test_layer_table_is_the_hand_computed_table() -> None:
    rows = figures.layer_table(hand_report())
    assert [tuple(r) for r in rows] == [figures.LAYER_COLUMNS] * 9
    got = [
        (r["layer"], r["task"], r["changed"], r["unique"], r["shared"], r["participating"])
        + (r["density"], r["unique_share"])
        for r in rows
    ]
    assert got == EXPECTED_LAYER_ROWS
    assert [r["model"] for r in rows[:3]] == [f"/data/agents/agent{i}" for i in (1, 2, 3)]


def test_layer_csv_rows_equal_the_table(tmp_path) -> None:
    report = hand_report()
    path = tmp_path / "layers.csv"
    figures.write_layer_csv(report, path)
    with open(path, newline="", encoding="utf-8") as f:
        read = list(csv.DictReader(f))
    assert read and list(read[0]) == list(figures.LAYER_COLUMNS)
    ints = ("task", "changed", "unique", "shared", "participating")
    parsed = [
        {
            k: (
                int(v)
                if k in ints
                else (float(v) if v else None)
                if k in ("density", "unique_share")
                else v
            )  # fmt: skip
            for k, v in row.items()
        }
        for row in read
    ]
    assert parsed == figures.layer_table(report)
    assert read[2]["unique_share"] == ""  # 0 changed: no unique share


def test_layer_heatmap_shows_the_densities(tmp_path) -> None:
    import numpy as np

    report = hand_report()
    report["layers"].append(
        {
            "layer": "lm_head",
            "tasks": [{"changed": 0, "unique": 0, "shared": 0, "participating": 0}] * 3,
        }
    )
    fig = figures.layer_heatmap(report)
    image = fig.axes[0].images[0]
    array = image.get_array()
    expected = np.array(
        [[100 * r[6] for r in EXPECTED_LAYER_ROWS[i : i + 3]] for i in range(0, 9, 3)]
    )
    np.testing.assert_array_equal(array[:3].filled(np.nan), expected)
    assert array.mask[3].all()  # no participating element: no density
    assert len(fig.axes) == 2  # the colorbar
    assert image.get_clim() == (0.0, 60.0)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "model.layers.0",
        "model.layers.1",
        "other",
        "lm_head",
    ]
    path = tmp_path / "heatmap.png"
    figures.write_layer_heatmap(report, path)
    assert png_size(path.read_bytes()) == (800, 600)


def test_layer_outputs_without_layer_statistics(tmp_path) -> None:
    report = hand_report()
    del report["layers"]
    assert figures.layer_table(report) == []
    figures.write_layer_csv(report, tmp_path / "l.csv")
    assert (tmp_path / "l.csv").read_text().strip() == ",".join(figures.LAYER_COLUMNS)
    with pytest.raises(ValueError, match="no per-layer statistics"):
        figures.layer_heatmap(report)


def test_markdown_summary_holds_the_table_values() -> None:
    text = figures.markdown_summary(hand_report())
    assert "RAM+" in text and "`ram_plus`" in text
    assert "r=0.1, alpha=2.0, epsilon=1e-05, scope=model" in text
    assert "probe only: no model written" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |")]
    assert rows[0].split(" | ")[1:] == [
        "`/data/agents/agent1`", "40", "4.00%", "10", "30", "3.0000", "1", "1.2", "1.075",
        "1.2 |",
    ]  # fmt: skip
    assert "| 2 | `/data/agents/agent2` | 500 | 50.00% | 250 | 250 | 1.0000 | 1 | 1.1 |" in text
    assert "| 3 | 100 (45.5%) | 110 (50.0%) | 10 (4.5%) |" in text
    assert "| 1 | 10 (25.0%) | 20 (50.0%) | 10 (25.0%) |" in text
    assert "participating elements: 1000; changed by no task: 445 (44.50%)" in text


def test_markdown_summary_of_a_merge_and_of_a_baseline() -> None:
    merge = hand_report()
    merge["output"] = {
        "url": "s3://AKIAEXAMPLE:wJalrSECRET@models/merged?X-Amz-Signature=abc123",
        "files_copied": [],
        "shards_reused": [],
        "shards_written": ["model.safetensors"],
    }
    merge["passes"]["map"] = dict(merge["passes"]["reduce"], bytes_written=2048)
    text = figures.markdown_summary(merge)
    assert "merged model: `s3://models/merged`" in text
    assert "SECRET" not in text and "AKIA" not in text and "abc123" not in text
    assert "map pass: 2 units, 0.5 s, 4096 bytes read, 2048 bytes written" in text

    ties = copy.deepcopy(merge)
    for key in ("tasks", "elements", "layers", "lambda_applied"):
        del ties[key]
    ties |= {"method": "ties", "parameters": {"density": [0.3, 0.3, 0.3]}}
    ties["ties"] = {"cuts_through_equal_magnitudes": 2}
    text = figures.markdown_summary(ties)
    assert "TIES" in text and "density=[0.3, 0.3, 0.3]" in text
    assert "- ties cuts through equal magnitudes: 2" in text
    assert "1. `/data/agents/agent1`" in text


def test_importing_ram_dist_does_not_import_matplotlib() -> None:
    code = (
        "import sys, ram_dist, ram_dist.report.figures, ram_dist.report.model_card\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
