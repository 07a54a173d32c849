"""`--device`: which units ask Ray for a GPU, on a real local Ray with two fake GPUs (Ray's
`num_gpus=2`, no CUDA: a task given a GPU still computes on the CPU, so the bytes can be
compared). A GPU task runs in a worker process of its own; CPU tasks share theirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from ram_dist.engine.devices import choose_device
from ram_dist.errors import RamDistError

CLI = [sys.executable, "-m", "ram_dist.cli"]


@pytest.fixture(scope="module")
def cuda_refused(inputs, tmp_path_factory) -> tuple[subprocess.Popen, Path]:
    """`ram-dist merge --device cuda` on an embedded Ray without GPUs, started in the
    background (its Ray starts while this module's does); the last test checks how it ended."""
    base, tasks = inputs
    out = tmp_path_factory.mktemp("refused") / "out"
    argv = ["merge", "--base", base, *[a for t in tasks for a in ("--task", t)], "--out", out]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the embedded Ray sees no GPU, even on a GPU machine
    run = subprocess.Popen(
        CLI + [str(a) for a in [*argv, "--device", "cuda"]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield run, out
    finally:
        if run.poll() is None:
            run.kill()
        run.communicate()


@pytest.fixture(scope="module")
def fake_gpus(cuda_refused):
    """A real Ray with two CPUs and two GPUs that do not exist."""
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A bf16 base of two tensors (a.weight: 64 bytes, b.weight: 12) and three tasks."""
    import torch
    from builders import save_checkpoint

    root = tmp_path_factory.mktemp("device")
    g = torch.Generator().manual_seed(0)
    base = {
        "a.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(6, generator=g).to(torch.bfloat16),
    }
    save_checkpoint(base, root / "base")
    tasks = []
    for i, density in enumerate((0.1, 0.5, 0.6)):
        task = {
            k: torch.where(torch.rand(v.shape, generator=g) < density, v.float() + 0.25, v.float())
            for k, v in base.items()
        }
        save_checkpoint({k: v.to(torch.bfloat16) for k, v in task.items()}, root / f"t{i}")
        tasks.append(root / f"t{i}")
    return root / "base", tasks


def _config(inputs, out=None, **kw):
    from ram_dist.config import MergeConfig

    base, tasks = inputs
    out = str(out) if out is not None else None
    return MergeConfig(base=str(base), tasks=tuple(map(str, tasks)), out=out, **kw)


def test_choose_device():
    auto = choose_device("auto", gpus=2, cpus=16)
    assert (auto.device, auto.gpus, auto.slots) == ("cuda", 2, 2)
    assert auto.reason == "auto: the cluster has 2 GPU(s) and 16 CPU(s): one unit per GPU"
    assert choose_device("auto", 0, 16).as_dict() == {
        "requested": "auto", "device": "cpu", "gpus": 0, "slots": 16,
        "reason": "auto: the cluster has 0 GPU(s) and 16 CPU(s): one unit per CPU",
    }  # fmt: skip
    cpu = choose_device("cpu", 2, 16)
    assert (cpu.device, cpu.gpus, cpu.slots) == ("cpu", 0, 16)
    assert "2 GPU(s) stay idle" in cpu.reason
    cuda = choose_device("cuda", 4, 16)
    assert (cuda.device, cuda.gpus, cuda.slots, cuda.reason) == (
        "cuda", 4, 4, "--device cuda: one unit per GPU"
    )  # fmt: skip
    with pytest.raises(RamDistError, match=r"^--device cuda, but the Ray cluster has no GPU"):
        choose_device("cuda", 0, 16)
    with pytest.raises(RamDistError, match="device must be one of auto, cpu, cuda"):
        choose_device("gpu", 2, 16)


def test_the_setting_from_flags_yaml_and_config(inputs, tmp_path):
    from ram_dist.cli import build_parser, config_from_args
    from ram_dist.config import MergeConfig

    base, tasks = inputs
    models = "".join(f"  - model: {t}\n" for t in tasks)
    yaml = tmp_path / "m.yaml"
    yaml.write_text(f"merge_method: ram_plus\nbase_model: {base}\nmodels:\n{models}device: cpu\n")
    parse = build_parser().parse_args
    assert config_from_args(parse(["merge", str(yaml), "--out", "o"])).device == "cpu"
    flagged = parse(["probe", str(yaml), "--device", "cuda"])
    assert config_from_args(flagged).device == "cuda"  # the flag wins over the file
    flags = ["plan", "--base", str(base), *[a for t in tasks for a in ("--task", str(t))]]
    assert config_from_args(parse(flags)).device == "auto"
    with pytest.raises(SystemExit):
        parse([*flags, "--device", "gpu"])
    yaml.write_text(yaml.read_text().replace("device: cpu", "device: gpu"))
    with pytest.raises(RamDistError, match="device 'gpu' is not one of auto, cpu, cuda"):
        config_from_args(parse(["merge", str(yaml), "--out", "o"]))
    with pytest.raises(RamDistError, match="device must be auto, cpu or cuda"):
        MergeConfig(base=str(base), tasks=tuple(map(str, tasks)), device="gpu")


def test_options_ask_for_a_gpu_and_a_fresh_process_only_on_cuda(inputs, fake_gpus):
    from ram_dist.engine.job import prepare
    from ram_dist.engine.passes import _options
    from ram_dist.engine.pool import unordered_map
    from ram_dist.engine.runtime import Cluster

    cluster = Cluster(cpus=2, gpus=2, embedded=False)
    for device in ("auto", "cuda"):
        in_flight, resources = _options(prepare(_config(inputs, device=device)), cluster)
        assert in_flight == 4 and resources["num_gpus"] == 1 and resources["max_calls"] == 1
    in_flight, cpu = _options(prepare(_config(inputs, device="cpu")), cluster)
    assert in_flight == 4 and "num_gpus" not in cpu and "max_calls" not in cpu
    with pytest.raises(RamDistError, match="no GPU"):
        _options(prepare(_config(inputs, device="cuda")), Cluster(cpus=2, gpus=0, embedded=False))

    def where(item: int) -> tuple[int, list[str]]:  # a Ray task: its process, its GPUs
        return os.getpid(), [str(g) for g in ray.get_gpu_ids()]

    # One task at a time: a GPU task's process exits after it, so no CUDA context made for
    # one GPU ever serves a task Ray gave another; CPU tasks keep reusing their process.
    ran = [r for _, _, r in unordered_map(where, range(3), (), 1, resources)]
    assert len({pid for pid, _ in ran}) == 3
    assert all(len(gpus) == 1 and gpus[0] in ("0", "1") for _, gpus in ran)
    ran = [r for _, _, r in unordered_map(where, range(4), (), 1, cpu)]
    assert len({pid for pid, _ in ran}) <= 2 and all(gpus == [] for _, gpus in ran)


def test_auto_uses_the_gpus_cpu_does_not_and_the_bytes_are_the_same(inputs, fake_gpus, tmp_path):
    import jsonschema
    import torch
    from builders import load_checkpoint
    from reference import reference_merge

    from ram_dist.engine import driver, work

    # called inline (this process is Ray's driver, not a task): CUDA whenever it is there
    assert work.task_gpus() is None
    assert work.device() == ("cuda" if torch.cuda.is_available() else "cpu")
    schema = json.loads((Path(driver.__file__).parents[1] / "report_schema.json").read_text())
    base, tasks = inputs
    states = [load_checkpoint(p) for p in [base, *tasks]]
    expected, _ = reference_merge(states[0], states[1:], "ram_plus")
    shards = {}
    for device in ("auto", "cpu"):
        out = tmp_path / device
        report = driver.merge(_config(inputs, out, device=device))
        jsonschema.Draft202012Validator(schema).validate(report)
        merged = load_checkpoint(out)
        assert merged.keys() == expected.keys()
        assert all(torch.equal(merged[k], v) for k, v in expected.items())
        shards[device] = (out / "model.safetensors").read_bytes()
        saved = json.loads((out / "merge_report.json").read_text())
        assert saved["device"] == report["device"]
        for name in ("reduce", "map"):  # one unit, one task each
            stats = report["passes"][name]
            assert stats["units"] == 1 and stats["tasks"] == 1, stats
            if device == "auto":  # the task held one of the two GPUs
                assert stats["tasks_on_gpu"] == 1 and stats["worker_processes"] == 1
                assert len(stats["gpu_ids"]) == 1 and stats["gpu_ids"][0] in ("0", "1")
            else:
                assert stats["tasks_on_gpu"] == 0 and stats["gpu_ids"] == []
        assert report["passes"]["map"]["fused_elements"] > 0  # on the CPU, fused, either way
    assert shards["auto"] == shards["cpu"]
    auto = json.loads((tmp_path / "auto" / "merge_report.json").read_text())["device"]
    assert auto == choose_device("auto", 2, 2).as_dict()
    cpu = json.loads((tmp_path / "cpu" / "merge_report.json").read_text())["device"]
    assert cpu == choose_device("cpu", 2, 2).as_dict()


def test_plan_says_the_device(inputs, fake_gpus, tmp_path, capsys):
    from ram_dist.cli import main
    from ram_dist.engine import driver

    planned = driver.plan(_config(inputs, tmp_path / "p"))
    assert planned["device"] == {
        **choose_device("auto", 2, 2).as_dict(),
        "cluster": "the Ray this process is connected to",
    }
    base, tasks = inputs
    argv = ["plan", "--base", str(base), *[a for t in tasks for a in ("--task", str(t))]]
    assert main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "device: cpu (--device cpu: one unit per CPU (2); its 2 GPU(s) stay idle)" in printed
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "device: cuda (auto: the cluster has 2 GPU(s) and 2 CPU(s): one unit per GPU)" in printed
    assert not (tmp_path / "p").exists()


def test_cuda_on_a_ray_without_gpus_exits_2_before_anything_runs(cuda_refused):
    run, out = cuda_refused
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("ram-dist: error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("ram-dist: error: --device cuda, but the Ray cluster has no GPU")
    assert not out.exists()  # nothing written, not even the output folder
