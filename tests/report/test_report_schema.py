"""The JSON reports validate against ram_dist/report_schema.json, and a renamed key does not.

The reports under test are real: the demo's merge (RAM+) on a real local Ray, the probe of the
same inputs, and a TIES merge of them; plus hand-written probe-shaped reports.
"""

from __future__ import annotations

import copy
import json
from importlib import resources

import jsonschema
import pytest
from hand_report import hand_report, png_size

from ram_dist.report import figures
from ram_dist.report.model_card import model_card


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    text = resources.files("ram_dist").joinpath("report_schema.json").read_text("utf-8")
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def real(ray_local, tmp_path_factory) -> dict:
    """The demo's merge report as written to disk, a probe and a TIES merge of its inputs."""
    from ram_dist.api import run_merge, run_probe
    from ram_dist.cli.demo import run_demo
    from ram_dist.planning.config import MergeConfig

    folder = tmp_path_factory.mktemp("demo")
    run_demo(str(folder))
    with open(folder / "merged" / "merge_report.json", encoding="utf-8") as f:
        merged = json.load(f)
    with open(folder / "merged" / "ram_dist_manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    base, tasks = str(folder / "base"), tuple(str(folder / f"agent{i}") for i in (1, 2, 3))
    probe = run_probe(MergeConfig(base=base, tasks=tasks)).data
    ties = run_merge(
        MergeConfig(base=base, tasks=tasks, out=str(folder / "ties"), method="ties")
    ).data
    # what `ram-dist probe --json` writes: the report through JSON
    probe = json.loads(json.dumps(probe))
    ties = json.loads(json.dumps(ties))
    return {"merge": merged, "probe": probe, "ties": ties, "manifest": manifest}


def errors(validator: jsonschema.Draft202012Validator, report: dict) -> list[tuple]:
    """Each error as (where in the report, which validator of the schema, its message); an
    `anyOf` error as (where, "anyOf", the messages of its alternatives)."""
    return [
        (tuple(e.absolute_path), e.validator, [c.message for c in e.context])
        if e.validator == "anyOf"
        else (tuple(e.absolute_path), e.validator, e.message)
        for e in validator.iter_errors(report)
    ]


def missing(*path) -> list[tuple]:
    """The one error of a report that lacks the key at `path`."""
    return [(tuple(path[:-1]), "required", f"{path[-1]!r} is a required property")]


#: RAM's report needs its lambdas in one of two forms.
NO_LAMBDAS = [
    (
        (),
        "anyOf",
        [f"{k!r} is a required property" for k in ("lambda_applied", "lambda_per_tensor")],
    )
]


@pytest.mark.parametrize("kind", ["merge", "probe", "ties"])
def test_real_reports_validate(validator, real, kind: str) -> None:
    assert errors(validator, real[kind]) == []


def test_real_reports_have_the_expected_shape(real) -> None:
    merge, probe = real["merge"], real["probe"]
    assert "output" in merge and "map" in merge["passes"]
    assert "output" not in probe and "map" not in probe["passes"]
    assert [t["changed"] for t in probe["tasks"]] == [t["changed"] for t in merge["tasks"]]
    assert "tasks" not in real["ties"] and "ties" in real["ties"]


def test_real_reports_feed_the_figures_and_the_card(real, tmp_path) -> None:
    probe = real["probe"]
    data = figures.figure2_data(probe)
    assert data["density"] == [t["density"] for t in probe["tasks"]]
    assert sum(data["changed"]) > 0
    rows = figures.layer_table(probe)
    assert len(rows) == len(probe["layers"]) * 3
    figures.write_figure2(probe, tmp_path / "f.png")
    figures.write_layer_heatmap(probe, tmp_path / "h.png")
    assert png_size((tmp_path / "f.png").read_bytes()) == (1000, 400)
    assert png_size((tmp_path / "h.png").read_bytes()) == (800, 600)
    summary = figures.markdown_summary(real["merge"])
    assert f"`{real['merge']['method']}`" in summary
    for i, task in enumerate(real["merge"]["tasks"], 1):
        assert f"| {i} | `{task['model']}` | {task['changed']} | " in summary
    inputs = real["manifest"]["identity"]["inputs"]
    card = model_card(real["merge"], base=real["merge"]["base"], inputs=inputs, version="0.1.0")
    assert real["merge"]["base"] in card


def test_hand_written_probe_report_validates(validator) -> None:
    report = hand_report()
    assert errors(validator, report) == []
    report["tasks"][0]["rho"] = "inf"  # a task with only shared changes
    assert errors(validator, report) == []
    baseline = {k: v for k, v in report.items() if k not in ("tasks", "elements", "layers")}
    baseline["method"] = "task_arithmetic"
    del baseline["lambda_applied"]
    assert errors(validator, baseline) == []


def rename(report: dict, path: tuple, new: str) -> dict:
    """A copy of `report` with the key at `path` renamed to `new`."""
    out = copy.deepcopy(report)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[new] = node.pop(path[-1])
    return out


@pytest.mark.parametrize(
    ("path", "new"),
    [
        (("tasks_given",), "tasks_list"),
        (("method",), "merge_method"),
        (("unit_budget_bytes",), "unit_size"),
        (("elements",), "element_counts"),
        (("elements", "by_count"), "bycount"),
        (("tasks",), "task_stats"),
        (("tasks", 1, "density"), "sparsity"),
        (("tasks", 0, "histogram"), "hist"),
        (("tasks", 2, "lambda", "ram_plus"), "ramplus"),
        (("layers",), "per_layer"),
        (("layers", 0, "tasks", 1, "participating"), "total"),
        (("lambda_applied",), "lambdas"),
        (("passes", "reduce"), "first_pass"),
        (("passes", "reduce", "bytes_read"), "read_bytes"),
        (("memory", "worker_peak_rss_bytes"), "worker_rss"),
    ],
)
def test_a_renamed_key_is_rejected(validator, path: tuple, new: str) -> None:
    want = NO_LAMBDAS if path == ("lambda_applied",) else missing(*path)
    assert errors(validator, rename(hand_report(), path, new)) == want


def test_a_merge_report_needs_its_map_pass_and_output_fields(validator) -> None:
    report = hand_report()
    report["output"] = {
        "url": "/m",
        "files_copied": [],
        "shards_reused": [],
        "shards_written": ["model.safetensors"],
    }
    assert errors(validator, report) == missing("passes", "map")  # output but no map pass
    report["passes"]["map"] = dict(report["passes"]["reduce"], bytes_written=10)
    assert errors(validator, report) == []
    assert errors(validator, rename(report, ("output", "url"), "location")) == missing(
        "output", "url"
    )
    skipped = copy.deepcopy(report)  # a resumed merge reuses the reduce statistics
    skipped["passes"]["reduce"] = {"skipped": True, "units": 0, "bytes_read": 0, "wall_s": 0.0}
    assert errors(validator, skipped) == []


NONE_OF = "is not valid under any of the given schemas"


@pytest.mark.parametrize(
    ("change", "value", "rule", "message"),
    [
        (("tasks", 0, "rho"), "infinity", "oneOf", f"'infinity' {NONE_OF}"),
        (("tasks", 0, "rho"), -1.0, "oneOf", f"-1.0 {NONE_OF}"),
        (("tasks", 0, "changed"), 40.5, "type", "40.5 is not of type 'integer'"),
        (("tasks", 0, "density"), "4%", "type", "'4%' is not of type 'number'"),
        (("elements", "participating"), -1, "minimum", "-1 is less than the minimum of 0"),
        (("out_dtype",), 16, "type", "16 is not of type 'string', 'null'"),
        (("notes",), "none", "type", "'none' is not of type 'array'"),
        (("method",), "", "minLength", "'' should be non-empty"),
    ],
)  # fmt: skip
def test_a_wrong_type_is_rejected(validator, change: tuple, value, rule: str, message: str) -> None:
    report = hand_report()
    node = report
    for key in change[:-1]:
        node = node[key]
    node[change[-1]] = value
    assert errors(validator, report) == [(change, rule, message)]


def test_method_specific_keys_are_required(validator) -> None:
    report = hand_report()
    del report["lambda_applied"]
    assert errors(validator, report) == NO_LAMBDAS  # RAM needs lambda_applied or ..._per_tensor
    report["lambda_per_tensor"] = {"model.embed_tokens.weight": [1.02, 1.0, 1.02]}
    assert errors(validator, report) == []  # ramplus_tl's form
    ties = {k: v for k, v in report.items() if k not in ("tasks", "elements", "layers")}
    ties["method"] = "ties"
    assert errors(validator, ties) == missing("ties")
    ties["ties"] = {"cuts_through_equal_magnitudes": 0}
    assert errors(validator, ties) == []
    dare = dict(ties, method="dare_ties")
    del dare["ties"]
    assert errors(validator, dare) == missing("dare")
    assert errors(validator, dict(dare, dare={"seed": 7})) == []
    extra = dict(hand_report(), something_new={"any": "shape"})  # extras are allowed
    assert errors(validator, extra) == []
