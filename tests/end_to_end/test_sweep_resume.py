"""A sweep SIGKILLed in its map pass resumes (docs/sweeps.md): every variant keeps the shards
it finished and the parts it holds of a shard being written, and the result is byte for
byte a clean sweep's and each variant's single merge; a rerun of another sweep is refused,
naming the run that writes it when one holds its lease."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from builders import build_model_set
from killing import env_without_ray, kill_sweep_mid_shard

import ram_dist
from ram_dist.cli import main
from ram_dist.io.lease import LEASE_NAME, Holder
from ram_dist.io.names import PARTIAL_SUFFIX, SWEEP_REPORT_NAME

SWEEP = ["--method", "ram_plus", "--method", "ties", "--grid", "r=0.1,0.2", "--grid", "density=0.5"]
VARIANTS = ["ram_plus-r0.1", "ram_plus-r0.2", "ties-density0.5"]
# One 128-wide bf16 row per unit, as test_resume.py's single merge has (about 850 units, a
# few hundred a shard: a map pass slow enough to be killed inside a shard): a sweep divides
# `--unit-mb` among its variants (docs/sweeps.md), so the sweep is given a row per variant.
ONE_ROW_MB = str(len(VARIANTS) * 256 / 2**20)


def _args(models: dict, out: Path, *extra: str) -> list[str]:
    args = ["merge", "--base", str(models["base"]), "--out", str(out), *extra]
    for t in models["tasks"]:
        args += ["--task", str(t)]
    return args


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sweep-resume")
    base, tasks, _, _ = build_model_set(root, base_shard="100KB", task_shard=70_000)
    return {"base": base, "tasks": tasks, "root": root}


@pytest.fixture(scope="module")
def crashed(models) -> dict:
    """A sweep whose driver and workers were SIGKILLed inside a shard of every variant: its
    folder, each variant's manifest then, its finished shards' mtimes, and the bytes of the
    parts recorded in its partial files."""
    out = models["root"] / "crashed"
    args = _args(models, out, *SWEEP, "--unit-mb", ONE_ROW_MB, "--workers", "1")
    kill_sweep_mid_shard(args, env_without_ray(), out, VARIANTS)
    manifests, mtimes, parts = {}, {}, {}
    for name in VARIANTS:
        folder = out / name
        manifests[name] = m = json.loads((folder / "ram_dist_manifest.json").read_text())
        mtimes[name] = {s: (folder / s).stat().st_mtime_ns for s in m["shards"]}
        for shard, w in m["writing"].items():
            data = (folder / f"{shard}{PARTIAL_SUFFIX}").read_bytes()
            for p in w["parts"].values():
                parts[(name, shard, p["start"])] = data[p["start"] : p["stop"]]
    assert not (out / SWEEP_REPORT_NAME).exists()
    return {"out": out, "manifests": manifests, "mtimes": mtimes, "parts": parts}


def _weights(folder: Path) -> dict[str, bytes]:
    names = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    names += [folder / "model.safetensors.index.json", folder / "mergekit_config.yml"]
    return {p.name: p.read_bytes() for p in names if p.exists()}


def test_a_killed_sweep_resumes_keeping_every_variant_s_parts(models, crashed, ray_local):
    out = models["root"] / "resumed"
    shutil.copytree(crashed["out"], out, copy_function=shutil.copy2)
    assert main(_args(models, out, *SWEEP)) == 0  # on this test's Ray: no second one started
    sweep = json.loads((out / SWEEP_REPORT_NAME).read_text())
    assert [v["name"] for v in sweep["variants"]] == VARIANTS
    assert sweep["passes"]["reduce"]["bytes_read"] == 0  # every variant held its statistics
    unfinished = reused = 0
    for name in VARIANTS:
        folder, manifest = out / name, crashed["manifests"][name]
        report = json.loads((folder / "merge_report.json").read_text())
        assert report["passes"]["reduce"]["skipped"] is True
        assert sorted(report["output"]["shards_reused"]) == sorted(manifest["shards"])
        for shard, mtime in crashed["mtimes"][name].items():  # not written again
            assert (folder / shard).stat().st_mtime_ns == mtime, (name, shard)
        for shard in manifest["shard_names"]:
            if shard not in manifest["shards"]:
                unfinished += (folder / shard).stat().st_size
        for (variant, shard, start), data in crashed["parts"].items():
            if variant == name:
                assert (folder / shard).read_bytes()[start : start + len(data)] == data
                reused += len(data)
        assert ram_dist.verify(str(folder)).ok
    assert reused > 0
    # The parts a variant held were made for the others only, and written to none again.
    assert report["passes"]["map"]["bytes_written_by_workers"] <= unfinished - reused
    # The same bytes as a clean sweep, and as each variant's single merge.
    clean = ram_dist.merge(
        base=models["base"], tasks=models["tasks"], out=models["root"] / "clean",
        methods=["ram_plus", "ties"], grid={"r": [0.1, 0.2], "density": [0.5]},
    )  # fmt: skip
    for v in clean["variants"]:
        got = _weights(out / v["name"])
        assert got == _weights(Path(v["out"])) and len(got) >= 3, v["name"]
        params = {k: val for k, val in v["parameters"].items() if not isinstance(val, list)}
        if v["method"] == "ties":
            params["density"] = 0.5
        single = ram_dist.merge(
            base=models["base"], tasks=models["tasks"], out=models["root"] / "one" / v["name"],
            method=v["method"], parameters=params,
        )  # fmt: skip
        assert got == _weights(Path(single.out)), v["name"]
    # A third run finds the sweep complete and does nothing.
    assert main(_args(models, out, *SWEEP)) == 0
    again = json.loads((out / SWEEP_REPORT_NAME).read_text())
    assert again == sweep


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--grid", "r=0.1,0.3"], "variant ram_plus-r0.2 removed; variant ram_plus-r0.3 added"),
        (["--method", "ties", "--grid", "density=0.5"], "variant ram_plus-r0.1 removed"),
        (["--method", "ram_plus", "--method", "ties", "--grid", "r=0.1,0.2", "--grid",
          "density=0.5", "--alpha", "3"], "parameter alpha: "),
    ],
)  # fmt: skip
def test_a_rerun_of_another_sweep_is_refused_naming_what_changed(
    models, crashed, tmp_path, capsys, extra, words
):
    out = tmp_path / "out"
    shutil.copytree(crashed["out"], out, copy_function=shutil.copy2)
    args = extra if extra[0] == "--method" else ["--method", "ram_plus", "--method", "ties",
                                                  "--grid", "density=0.5", *extra]  # fmt: skip
    assert main(_args(models, out, *args)) == 2
    err = capsys.readouterr().err
    assert words in err and "--overwrite" in err, err


def test_a_sweep_being_written_by_a_live_run_is_refused_naming_that_run(
    models, crashed, tmp_path, capsys
):
    """Another sweep's variants beside a live lease: the refusal names the run writing them,
    not what changed."""
    out = tmp_path / "out"
    shutil.copytree(crashed["out"], out, copy_function=shutil.copy2)
    now = time.time()
    holder = Holder("ram-dist sweep elsewhere", "other-host", 4242, now - 60, now - 5)
    (out / LEASE_NAME).write_text(holder.to_json())
    assert main(_args(models, out, "--method", "ties", "--grid", "density=0.5")) == 2
    err = capsys.readouterr().err
    assert "held by another ram-dist merge: job ram-dist sweep elsewhere" in err, err
    assert "removed" not in err
