"""The Python API (`ram_dist.merge`, `probe`, `plan`, `verify`): the README's example runs as
written and gives the bytes of the README's command; reports carry the values; a Ray the
process already has is used and left running; errors are the command's; settings and defaults
are the command's, from one place."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import ray
import torch
from builders import build_tiny_base, load_checkpoint, make_agents, save_checkpoint
from reference import reference_merge, reference_stats

import ram_dist
from ram_dist.api import MergeReport, PlanReport, ProbeReport, VerifyResult, job_config
from ram_dist.cli import build_parser, config_from_args, main
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config import Gradient

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
README = ROOT / "README.md"
TASKS = ("coder", "tool-user", "memory")


def _readme_example() -> str:
    """The Python block that follows `<!-- api-example -->`."""
    text = README.read_text()
    found = re.search(r"<!-- api-example -->\n```python\n(.*?)```", text, re.S)
    assert found, "README.md has no <!-- api-example --> python block"
    return found.group(1)


def _readme_usage_command() -> list[str]:
    """The merge of the README's Quick start (its first `ram-dist merge` command), as argv
    (without `ram-dist`)."""
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick_start, re.S)
    commands = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    first = next((c for c in commands if c.startswith("ram-dist merge ")), None)
    assert first, "the README's Quick start lost its `ram-dist merge` command"
    words = shlex.split(first)
    return words[1:]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """The README's inputs: ./qwen-base (three shards) and ./coder, ./tool-user, ./memory."""
    root = tmp_path_factory.mktemp("api")
    base = build_tiny_base(root / "qwen-base", max_shard_size="100KB")
    tasks = make_agents(base)
    for name, state in zip(TASKS, tasks, strict=True):
        save_checkpoint(state, root / name, copy_from=root / "qwen-base")
    return root, base, tasks


@pytest.fixture(scope="module")
def example_run(models) -> subprocess.CompletedProcess:
    """The README's example as a script: no Ray in the process, so it starts its own."""
    root, _, _ = models
    script = _readme_example() + "import ray\nprint('ray after:', ray.is_initialized())\n"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    names += ["model.safetensors.index.json"]
    return {name: (folder / name).read_bytes() for name in names}


def test_readme_example_runs_and_gives_the_commands_bytes(
    models, example_run, ray_local, monkeypatch
):
    root, base, tasks = models
    assert example_run.returncode == 0, example_run.stderr
    merged = root / "merged"
    expected, ref = reference_merge(base, tasks, "ram_plus", r=0.1, alpha=2.0)
    got = load_checkpoint(merged)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())

    printed = example_run.stdout.splitlines()
    stored = json.loads((merged / "merge_report.json").read_text())
    shards = tuple(stored["output"]["shards_written"])
    assert len(shards) == 3 and printed[0].startswith(f"{merged} {tuple(ref['lambda32'])} {shards}")
    assert printed[1] == str([round(d, 4) for d in ref["density"]])
    units, map_bytes = printed[2].split()  # units: from this machine's cores and memory
    assert int(units) >= 1 and int(map_bytes) == stored["passes"]["map"]["bytes_read"]
    assert printed[3:] == ["True", "ray after: False"]  # verified; its embedded Ray stopped

    # The README's command on the same inputs: the same bytes.
    argv = _readme_usage_command()
    argv[argv.index("--out") + 1] = "./merged-by-cli"
    monkeypatch.chdir(root)
    assert main(argv) == 0
    assert _shard_bytes(root / "merged-by-cli") == _shard_bytes(merged)


def test_merge_in_a_process_with_ray_uses_it_and_reports(models, example_run, ray_local, tmp_path):
    """A notebook's `ray.init()`: the merge runs on that Ray and leaves it running."""
    root, base, tasks = models
    job = ray.get_runtime_context().get_job_id()
    out = tmp_path / "merged"
    report = ram_dist.merge(
        base=root / "qwen-base", tasks=[root / t for t in TASKS], out=out,
        parameters={"r": 0.1, "alpha": 2.0}, unit_budget_bytes=8192,
    )  # fmt: skip
    assert ray.is_initialized() and ray.get_runtime_context().get_job_id() == job

    _, ref = reference_merge(base, tasks, "ram_plus", r=0.1, alpha=2.0)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert isinstance(report, MergeReport)
    assert (report.out, report.method, report.already_complete) == (str(out), "ram_plus", False)
    assert sorted(report.shards_written) == shards and report.shards_reused == ()
    assert report.bytes_written == sum((out / s).stat().st_size for s in shards)
    assert report.lambdas == tuple(ref["lambda32"])
    assert set(report.pass_seconds) == {"reduce", "map"}
    assert all(s > 0 for s in report.pass_seconds.values())
    assert report.config.unit_budget_bytes == 8192 and report["unit_budget_bytes"] == 8192
    stored = json.loads((out / "merge_report.json").read_text())
    assert report.as_dict() == stored and json.loads(report.to_json()) == stored
    assert [t["model"] for t in report["tasks"]] == [str(root / t) for t in TASKS]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.out = "elsewhere"  # type: ignore[misc]
    # Another unit budget than the README's example: the same bytes.
    assert _shard_bytes(out) == _shard_bytes(root / "merged")

    written = {s: (out / s).stat().st_mtime_ns for s in shards}
    again = ram_dist.merge(
        base=str(root / "qwen-base"), tasks=[str(root / t) for t in TASKS], out=str(out),
        parameters={"r": 0.1, "alpha": 2.0},
    )  # fmt: skip
    assert again.already_complete and again.out == str(out)
    assert again.lambdas == report.lambdas and again.shards_written == report.shards_written
    assert {s: (out / s).stat().st_mtime_ns for s in shards} == written  # nothing rewritten


def test_probe_plan_and_verify(models, example_run, ray_local, tmp_path):
    root, base, tasks = models
    inputs = {"base": root / "qwen-base", "tasks": [root / t for t in TASKS]}
    ref = reference_stats(base, tasks)

    # probe: RAM's statistics whatever the method, and the files of --json
    stats = ram_dist.probe(**inputs, method="ties", json_path=tmp_path / "stats" / "probe.json")
    assert isinstance(stats, ProbeReport) and stats.method == "ram_plus"
    assert [t["unique"] for t in stats.tasks] == ref["unique"]
    assert [t["shared"] for t in stats.tasks] == ref["shared"]
    assert [t["histogram"] for t in stats.tasks] == ref["H"]
    assert stats.densities == pytest.approx(ref["density"], rel=1e-12)
    assert stats.seconds > 0
    stem = tmp_path / "stats" / "probe"
    assert stats.files == tuple(
        str(p) for p in (stem.with_suffix(".json"), f"{stem}.figure2.png", f"{stem}.layers.csv",
                         f"{stem}.layers.png")
    )  # fmt: skip
    assert all(Path(f).stat().st_size > 0 for f in stats.files)
    assert (tmp_path / "stats" / "probe.json").read_text() == stats.to_json()

    # plan: nothing written, the state of each output
    planned = ram_dist.plan(**inputs, out=tmp_path / "new")
    assert isinstance(planned, PlanReport) and planned.output_state == "new"
    assert planned.output_path == "direct" and planned.device == "cpu"
    assert planned.work_units >= 1 and planned.method == "ram_plus"
    assert not (tmp_path / "new").exists()
    assert ram_dist.plan(**inputs, out=root / "merged").output_state == "complete"

    # verify: the README's output, then a copy with one byte changed
    result = ram_dist.verify(root / "merged")
    assert isinstance(result, VerifyResult) and result.ok and result.shards_checked == 3
    assert json.loads(result.to_json()) == result.as_dict()
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "merged", damaged)
    shard = sorted(damaged.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = ram_dist.verify(str(damaged))
    assert not result.ok and result.shards_checked == 3 and len(result.problems) == 1
    assert result.problems[0].startswith(f"shard {shard.name}: part ")


@pytest.mark.parametrize(
    "case",
    ["one task", "unknown method", "output inside an input", "no base", "bad parameter"],
)
def test_errors_are_the_commands_messages(models, ray_local, tmp_path, capsys, case):
    root, _, _ = models
    out = tmp_path / "out"
    api = {"base": str(root / "qwen-base"), "tasks": [str(root / t) for t in TASKS], "out": out}
    cli = ["merge", "--base", str(root / "qwen-base"), "--out", str(out)]
    cli += [a for t in TASKS for a in ("--task", str(root / t))]
    if case == "one task":
        api["tasks"] = api["tasks"][:1]
        cli = cli[:-4]
    elif case == "unknown method":
        api["method"], cli = "slerp", [*cli, "--method", "slerp"]
    elif case == "output inside an input":
        api["out"] = root / "coder" / "merged"
        cli[cli.index("--out") + 1] = str(root / "coder" / "merged")
    elif case == "no base":
        del api["base"]
        cli = cli[:1] + cli[3:]
    elif case == "bad parameter":
        api["parameters"], cli = {"alpha": -1.0}, [*cli, "--alpha", "-1"]
    with pytest.raises(RamDistError) as raised:
        ram_dist.merge(**api)
    assert main(cli) == 2
    assert capsys.readouterr().err == f"ram-dist: error: {raised.value}\n"
    assert not out.exists() and not (root / "coder" / "merged").exists()


def test_settings_and_defaults_are_the_commands(tmp_path):
    """The same job from the API's arguments as from the command's flags, a mergekit file
    under both: MergeConfig's defaults are the only defaults."""
    parse = build_parser().parse_args
    flags = ["--base", "b", "--task", "t1", "--task", "t2", "--out", "o"]
    assert job_config(base="b", tasks=["t1", "t2"], out="o") == config_from_args(
        parse(["merge", *flags])
    )
    mergekit = {
        "merge_method": "ties",
        "base_model": "b",
        "models": [
            {"model": "t1", "parameters": {"weight": 0.5, "density": 0.3}},
            {"model": "t2", "parameters": {"density": 0.7}},
        ],
        "parameters": {"normalize": False, "lambda": 2.0},
        "out_dtype": "bfloat16",
        "device": "cpu",
    }
    config_file = tmp_path / "ties.yaml"
    config_file.write_text(json.dumps(mergekit))  # JSON is YAML
    overrides = ["--lambda", "0.5", "--weight", "2", "--weight", "1", "--unit-mb", "1"]
    from_cli = config_from_args(parse(["merge", str(config_file), "o", *overrides]))
    for given in (config_file, str(config_file), mergekit):
        from_api = job_config(
            config=given, out=Path("o"), parameters={"lambda": 0.5},
            task_parameters=[{"weight": 2.0}, {"weight": 1.0}], unit_budget_bytes=2**20,
        )  # fmt: skip
        assert from_api == from_cli
    assert from_cli.task_parameters == (
        {"weight": 2.0, "density": 0.3},
        {"weight": 1.0, "density": 0.7},
    )
    assert from_cli.parameters == {"normalize": False, "lambda": 0.5}
    assert (from_cli.out_dtype, from_cli.device) == ("BF16", "cpu")

    # mergekit's forms from Python: a list across the layers
    layered = job_config(config=mergekit, parameters={"density": [0.2, 0.8]})
    assert layered.parameters["density"] == Gradient((0.2, 0.8))
    with pytest.raises(RamDistError, match=r"^config \(a mapping\): unknown key 'slerp_t'"):
        job_config(config={**mergekit, "slerp_t": 0.5})
    with pytest.raises(RamDistError, match="tasks must be a list of checkpoints"):
        job_config(base="b", tasks="t1")


def test_the_package_names_stay_the_api_after_every_module_is_imported():
    """`ram_dist.plan` and `ram_dist.verify` are functions, even once every submodule is loaded
    (a submodule import sets the package attribute of its name)."""
    for info in pkgutil.walk_packages(ram_dist.__path__, "ram_dist."):
        importlib.import_module(info.name)
    for name in ram_dist.__all__:
        if name != "__version__":
            value = getattr(ram_dist, name)
            assert callable(value) and not isinstance(value, ModuleType), name


_LIGHT = """
import sys
import ram_dist
result = ram_dist.verify(sys.argv[1])
print(result.ok, result.shards_checked, sorted(m for m in ("torch", "ray") if m in sys.modules))
"""


def test_import_and_verify_load_neither_torch_nor_ray(models, example_run):
    root, _, _ = models
    done = subprocess.run(
        [sys.executable, "-c", _LIGHT, str(root / "merged")], capture_output=True, text=True
    )
    assert done.stdout.strip() == "True 3 []", done.stderr
