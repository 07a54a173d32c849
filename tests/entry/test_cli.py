"""The `ram-dist` command: bad input stops it early with a clear message; YAML, probe, demo."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import shared_ray
import torch
import yaml
from builders import load_checkpoint, save_checkpoint
from method_cases import case_id, every_method, task_count
from reference import reference_merge, reference_stats

CLI = [sys.executable, "-m", "ram_dist.cli"]


def _state(seed: int, extra: dict | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "a.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(6, generator=g).to(torch.bfloat16),
    }
    return state | (extra or {})


def _task(base: dict, seed: int, density: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.where(torch.rand(v.shape, generator=g) < density, v.float() + 0.25, v.float()).to(
            v.dtype
        )
        for k, v in base.items()
    }


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, list[Path]]:
    base = _state(0)
    save_checkpoint(base, tmp_path / "base")
    tasks = []
    for i, density in enumerate((0.1, 0.5, 0.6)):
        save_checkpoint(_task(base, 10 + i, density), tmp_path / f"t{i}")
        tasks.append(tmp_path / f"t{i}")
    return tmp_path / "base", tasks


def _subprocess(args: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command in a process of its own: with its embedded Ray, or as `env` says (the
    shared Ray's address: `shared_ray.joining_env`)."""
    env = env or {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        CLI + [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.usefixtures("ray_local")
def test_yaml_merge_and_probe_json(inputs, tmp_path):
    """Both commands join the shared Ray (the demo's test starts the embedded one)."""
    base, tasks = inputs
    joined = shared_ray.joining_env()
    config = tmp_path / "merge.yaml"
    models = "\n".join(f"  - model: {t}" for t in [base, *tasks])
    config.write_text(
        f"merge_method: ram_plus_soft\nbase_model: {base}\nmodels:\n{models}\n"
        "parameters:\n  r: 0.3\n  epsilon: 1e-5\nout_dtype: float32\n"
    )
    done = _subprocess(["merge", config, tmp_path / "out", "--unit-mb", "0.0001"], tmp_path, joined)
    assert done.returncode == 0, done.stderr
    states = [load_checkpoint(p) for p in [base, *tasks]]
    expected, ref = reference_merge(
        states[0], states[1:], "ram_plus_soft", r=0.3, out_dtype=torch.float32
    )
    merged = load_checkpoint(tmp_path / "out")
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    report = json.loads((tmp_path / "out" / "merge_report.json").read_text())
    assert report["method"] == "ram_plus_soft" and report["parameters"]["r"] == 0.3
    assert report["lambda_applied"] == ref["lambda32"]
    assert "merged model written to" in done.stdout and "lambda[ram_plus]" in done.stdout
    card = (tmp_path / "out" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == str(base) and {"merge", "ram-dist"} <= set(meta["tags"])
    effective = yaml.safe_load((tmp_path / "out" / "mergekit_config.yml").read_text())
    assert effective["merge_method"] == "ram_plus_soft" and effective["parameters"]["r"] == 0.3

    probe_json = tmp_path / "stats" / "probe.json"  # a folder that does not exist yet
    args = ["probe", "--base", base, "--json", probe_json] + sum([["--task", t] for t in tasks], [])
    done = _subprocess(args, tmp_path, joined)
    assert done.returncode == 0, done.stderr
    probe = json.loads(probe_json.read_text())
    stats = reference_stats(states[0], states[1:])
    assert [t["histogram"] for t in probe["tasks"]] == [list(map(int, h)) for h in stats["H"]]
    assert [t["changed"] for t in probe["tasks"]] == [
        u + s for u, s in zip(stats["unique"], stats["shared"], strict=True)
    ]
    assert probe["elements"]["unchanged"] == stats["unchanged"]
    assert "map" not in probe["passes"]
    figure = (tmp_path / "stats" / "probe.figure2.png").read_bytes()
    assert figure[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", figure[16:24]) == (1000, 400)
    rows = list(csv.DictReader((tmp_path / "stats" / "probe.layers.csv").open()))
    assert {r["layer"] for r in rows} == {layer["layer"] for layer in probe["layers"]}
    heatmap = (tmp_path / "stats" / "probe.layers.png").read_bytes()
    assert heatmap[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", heatmap[16:24]) == (800, 600)
    for line in ("overlap histogram", "density", "rho"):
        assert line in done.stdout


def test_demo_command_merges_its_generated_agents(tmp_path):
    done = _subprocess(["demo", "--dir", tmp_path / "demo"], tmp_path)
    assert done.returncode == 0, done.stderr
    demo = tmp_path / "demo"
    base = load_checkpoint(demo / "base")
    tasks = [load_checkpoint(demo / f"agent{i}") for i in (1, 2, 3)]
    expected, ref = reference_merge(base, tasks, "ram_plus")
    merged = load_checkpoint(demo / "merged")
    assert all(torch.equal(merged[k], v) for k, v in expected.items())
    densities = [u + s for u, s in zip(ref["unique"], ref["shared"], strict=True)]
    assert [x / ref["d"] for x in densities] == pytest.approx([0.03, 0.46, 0.54], abs=0.02)
    assert "overlap histogram" in done.stdout
    # The embedded Ray starts quietly: not its token-authentication notice on every run.
    assert "Token authentication" not in done.stderr, done.stderr
    assert done.stdout.endswith(
        f"merged model (RAM+, r=0.1, alpha=2.0) written to {demo / 'merged'}\n"
    )
    # The merged model's index maps every tensor to the shard the base keeps it in.
    index = json.loads((demo / "merged" / "model.safetensors.index.json").read_text())
    given = json.loads((demo / "base" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == given["weight_map"] and set(index["weight_map"]) == set(merged)
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in merged.values()
    )


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("case", every_method(), ids=case_id)
def test_merge_prints_a_summary_for_every_method(inputs, tmp_path, capsys, case):
    """Every method of the registry through the command, its parameters given by their own
    flags: the summary prints what its report adds (the method's `report_lines`), and the
    file holds the merge the flags asked for."""
    from ram_dist.cli import main
    from ram_dist.methods.registry import METHODS

    method, params = case
    declared = {p.name: p for p in METHODS[method].parameters}
    base, tasks = inputs
    tasks = tasks[: task_count(method, len(tasks))]
    out = tmp_path / method
    argv = ["merge", "--base", base, *[a for t in tasks for a in ("--task", t)], "--out", out]
    flags = [a for k, v in params.items() for a in (declared[k].cli_flag, v)]
    assert main([str(a) for a in [*argv, "--method", method, *flags]]) == 0
    printed = capsys.readouterr().out
    assert f"written to {out}" in printed
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == method
    assert ("tasks" in report) == METHODS[method].reports_overlap  # overlap statistics
    for line in METHODS[method].report_lines(report):
        assert line in printed, line
    if not METHODS[method].reports_overlap:
        assert f"method: {method}" in printed
        for i, task in enumerate(tasks, 1):
            assert f"task {i}: {task}\n" in printed
    # The file holds the merge the flags asked for: the Python API's bytes for the same job,
    # computed on the eager path with one unit per tensor (tests/methods/ and
    # tests/exactness/ hold that path to the references and to mergekit).
    import ram_dist

    again = tmp_path / f"{method}-api"
    ram_dist.merge(base=base, tasks=tasks, out=again, method=method, parameters=params or None,
                   kernels="eager", unit_budget_bytes=1 << 20)  # fmt: skip
    merged, want, given = load_checkpoint(out), load_checkpoint(again), load_checkpoint(base)
    assert merged.keys() == want.keys() == given.keys()
    for name, tensor in want.items():
        assert merged[name].dtype == tensor.dtype == given[name].dtype, name
        assert merged[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
    assert any(not merged[n].equal(given[n]) for n in given)  # the tasks changed the base


_LOADED = """
import sys
from ram_dist.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
loaded = sorted(m for m in ("torch", "ray", "numba") if m in sys.modules)
import ray
print(code, loaded, ray.is_initialized())
"""


def _loaded(*argv: str) -> str:
    """What a fresh process that ran `ram-dist ARGV` had imported (before the final check)."""
    done = subprocess.run([sys.executable, "-c", _LOADED, *argv], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


_IMPORTED = """
import sys
import ram_dist.cli
from ram_dist.cli import demo
print(sorted(m for m in ("torch", "ray", "numba", "fsspec", "safetensors") if m in sys.modules))
"""


def test_the_command_and_its_demo_import_no_tensor_library_store_or_ray():
    """What `ram-dist` imports before it parses its flags, and `demo` before Ray's start:
    torch, the stores (fsspec) and Ray load later, the first two beside Ray's start."""
    done = subprocess.run([sys.executable, "-c", _IMPORTED], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_help_and_verify_load_neither_torch_nor_ray_and_plan_starts_no_ray(tmp_path):
    assert _loaded("--help") == "0 [] False"
    assert _loaded("merge", "--help") == "0 [] False"
    base, tasks = tmp_path / "base", [tmp_path / "t1", tmp_path / "t2"]
    save_checkpoint(_state(0), base)
    for i, t in enumerate(tasks):
        save_checkpoint(_state(i + 1), t)
    out = tmp_path / "out"
    args = ["--base", str(base), "--task", str(tasks[0]), "--task", str(tasks[1])]
    assert (
        subprocess.run([*CLI, "merge", *args, "--out", str(out)], capture_output=True).returncode
        == 0
    )
    # verify: the output's manifest, index and shards; no tensor library, no cluster
    assert _loaded("verify", str(out)) == "0 [] False"
    # plan reads headers with torch loaded (the dtypes), but starts no Ray
    assert _loaded("plan", *args, "--out", str(tmp_path / "p")).endswith("False")
