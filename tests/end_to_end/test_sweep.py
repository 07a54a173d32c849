"""Sweeps (docs/sweeps.md): every variant byte for byte its single merge, for every family
of methods, from the reads of one merge; refusals before any work; `verify` and transformers
on the variants; the CLI's flags, the YAML key and the documented Python example."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from builders import build_model_set

import ram_dist
from ram_dist.cli import main
from ram_dist.io.names import SWEEP_REPORT_NAME
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.sweep import prepare_sweep

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: One of each family (RAM, TIES/DARE/DELLA/breadcrumbs, geometric, model_stock, sce), with
#: a grid over RAM+'s r and alpha (whose statistics coincide) and the densities.
METHODS = ["ram_plus", "ties", "dare_ties", "della", "breadcrumbs", "karcher", "model_stock",
           "sce"]  # fmt: skip
GRID = {"r": [0.1, 0.3], "alpha": [1.0, 2.0], "density": [0.5, 0.8]}
#: A small unit budget: many units and parts, so that every part is made for every variant.
UNIT = 48 << 10


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sweep")
    base, tasks, _, _ = build_model_set(root, base_shard="100KB")
    return {"base": base, "tasks": tasks, "root": root}


def _files(folder: Path) -> dict[str, bytes]:
    """The weights, index and mergekit config of an output, by name."""
    names = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    names += [folder / "model.safetensors.index.json", folder / "mergekit_config.yml"]
    return {p.name: p.read_bytes() for p in names if p.exists()}


@pytest.fixture(scope="module")
def swept(models, ray_local) -> dict:
    out = models["root"] / "sweep"
    report = ram_dist.merge(
        base=models["base"], tasks=models["tasks"], out=out, methods=METHODS, grid=GRID,
        unit_budget_bytes=UNIT,
    )  # fmt: skip
    return {"out": out, "report": report.data}


def test_a_sweep_names_every_variant_of_each_method_s_own_grid(swept):
    names = [v["name"] for v in swept["report"]["variants"]]
    assert names == [
        "ram_plus-r0.1-alpha1", "ram_plus-r0.1-alpha2", "ram_plus-r0.3-alpha1",
        "ram_plus-r0.3-alpha2", "ties-density0.5", "ties-density0.8", "dare_ties-density0.5",
        "dare_ties-density0.8", "della-density0.5", "della-density0.8",
        "breadcrumbs-density0.5", "breadcrumbs-density0.8", "karcher", "model_stock", "sce",
    ]  # fmt: skip
    on_disk = json.loads((swept["out"] / SWEEP_REPORT_NAME).read_text())
    assert on_disk["variants"] == swept["report"]["variants"]
    assert set(on_disk["passes"]) == {"reduce", "map"}
    assert on_disk["unit_budget_bytes"] == UNIT // len(names)  # divided among the variants
    for v in on_disk["variants"]:
        assert Path(v["out"]) == swept["out"] / v["name"]
    first = on_disk["variants"][1]
    assert (first["parameters"]["r"], first["parameters"]["alpha"]) == (0.1, 2.0)


def test_each_variant_is_its_single_merge_byte_for_byte_from_one_merge_s_reads(models, swept):
    """Every variant's shards, index and mergekit_config.yml are those of the single merge
    with its method and parameters; the sweep read, per pass, what the single merge with the
    most reduce reads read (one read of the inputs per round, whatever the variants)."""
    singles = []
    for v in swept["report"]["variants"]:
        params = {k: val for k, val in v["parameters"].items() if not isinstance(val, list)}
        density = v["parameters"].get("density")
        if density is not None:
            params["density"] = density[0]
        single = ram_dist.merge(
            base=models["base"], tasks=models["tasks"], out=models["root"] / "one" / v["name"],
            method=v["method"], parameters=params, unit_budget_bytes=UNIT,
        )  # fmt: skip
        singles.append(single.data)
        got, want = _files(Path(v["out"])), _files(Path(single.out))
        assert set(got) == set(want) and len(got) >= 3, v["name"]
        for name in want:
            assert got[name] == want[name], (v["name"], name)
        manifest = json.loads((Path(v["out"]) / "ram_dist_manifest.json").read_text())
        one = json.loads((Path(single.out) / "ram_dist_manifest.json").read_text())
        assert manifest["identity"] == one["identity"] and manifest["complete"]
        assert manifest["statistics"] == one["statistics"], v["name"]
    passes = swept["report"]["passes"]
    assert passes["map"]["bytes_read"] == singles[0]["passes"]["map"]["bytes_read"]
    most = max(s["passes"]["reduce"]["bytes_read"] for s in singles)
    assert passes["reduce"]["bytes_read"] == most


def test_ram_plus_over_r_and_alpha_counts_once(models):
    """Variants whose statistics coincide share them: RAM+ over r and alpha counts once;
    TIES's first round (magnitude histograms) is one for TIES and consensus TIES at every
    density; its later rounds (the cuts) one per density."""
    config = MergeConfig(
        base=str(models["base"]), tasks=tuple(map(str, models["tasks"])),
        out=str(models["root"] / "unused"), methods=("ram_plus", "ram", "ties", "consensus_ties"),
        grid=GRID,
    )  # fmt: skip
    sweep = prepare_sweep(config)
    state = sweep.job.initial_state()
    share = state["share"]
    assert [v.name for v in sweep.variants][:5] == [
        "ram_plus-r0.1-alpha1", "ram_plus-r0.1-alpha2", "ram_plus-r0.3-alpha1",
        "ram_plus-r0.3-alpha2", "ram-r0.1-alpha1",
    ]  # fmt: skip
    assert [v.name for v in sweep.variants][8:] == [
        "ties-density0.5", "ties-density0.8", "consensus_ties-density0.5",
        "consensus_ties-density0.8",
    ]  # fmt: skip
    assert share[:8] == [0, 0, 0, 0, 0, 0, 0, 0]  # ram too: the same counts
    assert share[8:] == [8, 8, 8, 8]
    later = sweep.job.method._share(1, sweep.job.params, state["variants"])
    assert later[8:] == [8, 9, 8, 9]


def test_ties_and_consensus_ties_sharing_rounds_write_their_single_merges_bytes(
    models, tmp_path, ray_local
):
    """TIES and consensus TIES at two densities share their first round (one set of
    magnitude histograms) and, per density, every later round: each variant's shards and
    statistics are still its single merge's."""
    out = tmp_path / "sweep"
    report = ram_dist.merge(
        base=models["base"], tasks=models["tasks"], out=out, unit_budget_bytes=UNIT,
        methods=["ties", "consensus_ties"], grid={"density": [0.5, 0.8]},
    ).data  # fmt: skip
    assert len(report["variants"]) == 4
    for v in report["variants"]:
        single = ram_dist.merge(
            base=models["base"], tasks=models["tasks"], out=tmp_path / "one" / v["name"],
            method=v["method"], parameters={"density": v["parameters"]["density"][0]},
            unit_budget_bytes=UNIT,
        )  # fmt: skip
        got, want = _files(Path(v["out"])), _files(Path(single.out))
        assert set(got) == set(want) and len(got) >= 3, v["name"]
        for name in want:
            assert got[name] == want[name], (v["name"], name)
        manifest = json.loads((Path(v["out"]) / "ram_dist_manifest.json").read_text())
        one = json.loads((Path(single.out) / "ram_dist_manifest.json").read_text())
        assert manifest["statistics"] == one["statistics"], v["name"]


def test_every_variant_verifies_and_loads_in_transformers(swept):
    """Each variant's folder verifies, holds a report that validates against the report's
    schema, a model card and the base's config; transformers loads one."""
    from transformers import AutoModelForCausalLM

    text = resources.files("ram_dist").joinpath("report_schema.json").read_text("utf-8")
    schema = jsonschema.Draft202012Validator(json.loads(text))
    for v in swept["report"]["variants"]:
        result = ram_dist.verify(v["out"])
        assert result.ok and result.shards_checked >= 1, (v["name"], result.problems)
        report = json.loads((Path(v["out"]) / "merge_report.json").read_text())
        assert report["method"] == v["method"]
        schema.validate(report)
        assert (Path(v["out"]) / "README.md").exists() and (Path(v["out"]) / "config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(swept["report"]["variants"][0]["out"])
    assert sum(p.numel() for p in model.parameters()) > 0


def _cli(models, out: Path, *extra: str) -> list[str]:
    args = ["merge", "--base", str(models["base"]), "--out", str(out), *extra]
    for t in models["tasks"]:
        args += ["--task", str(t)]
    return args


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--method", "ram_plus", "--method", "slerp"], "slerp merges exactly one task model"),
        (["--method", "ram_plus", "--grid", "density=0.5"], "grid density: no chosen method"),
        (["--method", "ties", "--grid", "density=half"], "'half' is not a float"),
        (["--method", "ram_plus", "--method", "della", "--eps", "0.1"], "is --della-epsilon"),
    ],
)
def test_a_sweep_it_cannot_make_exits_2_before_any_work(models, tmp_path, capsys, extra, words):
    out = tmp_path / "out"
    assert main(_cli(models, out, *extra)) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert not out.exists()


def test_the_command_line_and_the_yaml_key_sweep(models, tmp_path, capsys, ray_local):
    """`--method` twice and `--grid` on the command line, `sweep:` in a config: the same
    variants, the same bytes; `plan` lists the variants and what each pass reads."""
    args = ["--method", "ram_plus", "--method", "task_arithmetic", "--grid", "r=0.1,0.2"]
    assert main(["plan", *_cli(models, tmp_path / "p", *args)[1:], "--log-format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    names = [v["name"] for v in planned["sweep"]["variants"]]
    assert names == ["ram_plus-r0.1", "ram_plus-r0.2", "task_arithmetic"]
    assert main(_cli(models, tmp_path / "cli", *args, "--unit-mb", "0.05")) == 0
    config = {
        "merge_method": "ram_plus",
        "base_model": str(models["base"]),
        "models": [{"model": str(t)} for t in models["tasks"]],
        "sweep": {"methods": ["ram_plus", "task_arithmetic"], "grid": {"r": [0.1, 0.2]}},
    }
    report = ram_dist.merge(config=config, out=tmp_path / "yaml", unit_budget_bytes=UNIT)
    assert [v["name"] for v in report["variants"]] == names
    for name in names:
        assert _files(tmp_path / "cli" / name) == _files(tmp_path / "yaml" / name), name


def test_the_sweeps_page_s_python_example_runs(models, tmp_path, monkeypatch, ray_local):
    text = (DOCS / "sweeps.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    for i, t in enumerate(models["tasks"]):
        (tmp_path / f"task{i}").symlink_to(t)
    (tmp_path / "base").symlink_to(models["base"])
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "docs/sweeps.md", "exec"), {})
    report = json.loads((tmp_path / "sweep" / SWEEP_REPORT_NAME).read_text())
    assert len(report["variants"]) >= 2
    for v in report["variants"]:
        assert ram_dist.verify(v["out"]).ok
