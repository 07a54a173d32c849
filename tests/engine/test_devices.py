"""`--device`: where the units run, on a real local Ray with two CPUs and two fake GPUs
(Ray's `num_gpus=2`, no CUDA: a GPU worker computes the eager rule on the CPU, so the bytes
can be compared). The fused kernels keep every unit on the CPUs; GPU work runs in one
long-lived worker process per GPU, whatever the number of units.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from ram_dist.errors import RamDistError
from ram_dist.planning.devices import EagerTensors, choose_device

CLI = [sys.executable, "-m", "ram_dist.cli"]
#: Bytes a unit may read from each input: the fixture's model makes about 50 units.
UNIT = 256


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
def fake_gpus(cuda_refused, own_ray):
    """A real Ray with two CPUs and two GPUs that do not exist."""
    from conftest import local_ray

    with local_ray(num_cpus=2, num_gpus=2):
        yield


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A bf16 base of three tensors (8 KiB, 12 bytes and 3 KiB) and three tasks."""
    import torch
    from builders import save_shifted_tasks

    root = tmp_path_factory.mktemp("device")
    g = torch.Generator().manual_seed(0)
    base = {
        "a.weight": torch.randn(128, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(6, generator=g).to(torch.bfloat16),
        "c.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
    }
    return save_shifted_tasks(root, base, (0.1, 0.5, 0.6), 0.25, g)


def _config(inputs, out=None, **kw):
    from ram_dist.planning.config import MergeConfig

    base, tasks = inputs
    out = str(out) if out is not None else None
    return MergeConfig(base=str(base), tasks=tuple(map(str, tasks)), out=out, **kw)


def test_choose_device():
    fused = choose_device("auto", gpus=2, cpus=16)
    assert (fused.device, fused.gpus, fused.cpu_slots, fused.slots) == ("cpu", 0, 16, 16)
    assert fused.reason == (
        "auto: the fused CPU kernels take every merged tensor, and merging is bound by "
        "storage: one unit per CPU (16); the 2 GPU(s) stay idle"
    )
    assert choose_device("auto", 0, 16).as_dict() == {
        "requested": "auto", "device": "cpu", "gpus": 0, "cpu_slots": 16, "slots": 16,
        "reason": "auto: no GPU: one unit per CPU (16)",
    }  # fmt: skip
    cpu = choose_device("cpu", 2, 16)
    assert (cpu.device, cpu.gpus, cpu.slots) == ("cpu", 0, 16)
    assert "2 GPU(s) stay idle" in cpu.reason
    cuda = choose_device("cuda", 4, 16)
    assert (cuda.device, cuda.gpus, cuda.cpu_slots, cuda.slots) == ("cuda", 4, 0, 8)
    assert cuda.reason == (
        "--device cuda: every unit on the GPUs, one worker per GPU (4), 2 units at a time each"
    )
    some = EagerTensors(frozenset({"x", "x_scale_inv"}), 1, 10, "F64 tensors")
    split = choose_device("auto", 2, 16, some)
    assert (split.device, split.gpus, split.cpu_slots, split.slots) == ("cpu+cuda", 2, 14, 18)
    assert split.reason.startswith("auto: 1 of 10 merged tensors need the eager rule (F64")
    assert "the other units on the other 14 CPU(s)" in split.reason
    crowded = choose_device("auto", 2, 2, some)  # the GPU workers hold every CPU
    assert (crowded.device, crowded.cpu_slots) == ("cuda", 0)
    assert crowded.reason.endswith("they hold the 2 CPU(s)")
    every = choose_device("auto", 2, 16, EagerTensors(frozenset({"x"}), 3, 3, "why"))
    assert (every.device, every.gpus, every.cpu_slots) == ("cuda", 2, 0)
    products = choose_device("auto", 2, 16, EagerTensors(frozenset({"w"}), 0, 4, "", 1))
    assert products.device == "cpu+cuda" and products.reason.startswith(
        "auto: 1 of 4 merged tensors have LoRA products to compute: their units on the GPUs"
    )
    both = choose_device("auto", 2, 16, EagerTensors(frozenset({"w", "x"}), 1, 2, "F64 tensors", 1))
    assert both.device == "cuda" and both.reason.startswith(
        "auto: 1 of 2 merged tensors need the eager rule (F64 tensors); 1 of 2 merged tensors "
        "have LoRA products to compute: every unit on the GPUs"
    )
    with pytest.raises(RamDistError, match=r"^--device cuda, but the Ray cluster has no GPU"):
        choose_device("cuda", 0, 16)
    with pytest.raises(RamDistError, match="device must be one of auto, cpu, cuda"):
        choose_device("gpu", 2, 16)


def test_which_tensors_need_the_eager_rule(inputs, tmp_path):
    import torch
    from builders import save_checkpoint

    from ram_dist.planning.job import prepare
    from ram_dist.planning.units import Piece, WorkUnit

    def choice(**kw):
        return prepare(_config(inputs, **kw)).device_choice(gpus=2, cpus=8)

    assert choice(method="ram_plus").device == "cpu"
    assert choice(method="ties", parameters={"density": 0.5}).device == "cpu"
    assert choice(method="dare_ties", parameters={"density": 0.5}).device == "cpu"
    rescaled = choice(method="ties", parameters={"density": 0.5, "rescale": True})
    assert rescaled.device == "cuda"
    assert "need the eager rule (ties has no fused kernel" in rescaled.reason
    eager = choice(method="ram_plus", kernels="eager")
    assert "3 of 3 merged tensors need the eager rule (--kernels eager)" in eager.reason
    assert choice(method="ram_plus", out_dtype="float64").device == "cpu"  # kernels write F64
    for name in ("base", "t0", "t1"):  # float64 inputs: the spec computes them in float64
        save_checkpoint({"w": torch.full((4,), 1.0 + len(name), dtype=torch.float64)},
                        tmp_path / name)  # fmt: skip
    config = _config((tmp_path / "base", [tmp_path / "t0", tmp_path / "t1"]))
    wide = prepare(config).device_choice(gpus=2, cpus=8)
    assert (
        wide.device == "cuda"
        and "1 of 1 merged tensors need the eager rule (F64 tensors)" in wide.reason
    )
    # units of a tensor that needs the eager rule go to the GPUs, the others stay
    unit = WorkUnit(0, "model.safetensors", (Piece("a.weight", 0, 4),))
    assert rescaled.on_gpu([unit]) and not choice(method="ram_plus").on_gpu([unit])


def test_the_setting_from_flags_yaml_and_config(inputs, tmp_path):
    from ram_dist.cli import build_parser, config_from_args
    from ram_dist.planning.config import MergeConfig

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


def test_gpu_workers_live_for_the_job_two_units_at_once(fake_gpus, tmp_path):
    from ram_dist.engine.gpu import GpuWorkers
    from ram_dist.engine.pool import Routing, unordered_map

    # Functions defined here travel to the workers by value (this module is not importable
    # there).
    def _where(item: int) -> dict:
        """A pool item: which process, thread and GPUs ran it, and when."""
        started = time.monotonic()
        time.sleep(0.2)
        return {
            "pid": os.getpid(), "thread": threading.get_ident(), "gpus": list(ray.get_gpu_ids()),
            "started": started, "ended": time.monotonic(),
        }  # fmt: skip

    def _dies_once(item: int, marker: str) -> int:
        """Kills its worker process the first time item 3 runs."""
        if item == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        time.sleep(0.05)
        return os.getpid()

    def _dies(item: int) -> None:
        os._exit(1)

    def _refuses(item: int) -> None:
        raise RamDistError(f"tensor 'x' in item {item}: bad")

    def _all(item: int) -> bool:
        return True

    workers = GpuWorkers(2)
    try:
        start = time.monotonic()
        on_workers = Routing(gpu=workers, on_gpu=_all)
        ran = [r for _, _, r in unordered_map(_where, range(12), (), 4, {}, on_workers)]
        wall = time.monotonic() - start
        assert len({r["pid"] for r in ran}) == 2  # twelve items, two processes
        assert {len(r["gpus"]) for r in ran} == {1}
        assert len({r["gpus"][0] for r in ran}) == 2  # each its own GPU, for its whole life
        for pid in {r["pid"] for r in ran}:  # two at a time in each, in two threads
            mine = [r for r in ran if r["pid"] == pid]
            assert len({r["thread"] for r in mine}) == 2
            assert any(a["started"] < b["ended"] and b["started"] < a["ended"]
                       for a in mine for b in mine if a is not b)  # fmt: skip
        assert 0.0 < workers.busy_share(wall) <= 1.0
        assert workers.busy_share(wall) == 0.0  # counted once
        # items not for the GPUs run as CPU tasks, which hold no GPU (asking for no CPU
        # here: the two GPU workers hold this cluster's two)
        halves = Routing(gpu=workers, on_gpu=lambda i: i % 2)
        odd = [r for _, _, r in unordered_map(_where, range(6), (), 2, {"num_cpus": 0}, halves)]
        assert sorted(len(r["gpus"]) for r in odd) == [0, 0, 0, 1, 1, 1]
        assert {r["pid"] for r in odd if r["gpus"]} <= {r["pid"] for r in ran}
        assert workers.processes == {f"{os.uname().nodename}:{r['pid']}" for r in ran}

        # a worker that dies is replaced, and the unit it held runs again
        marker = str(tmp_path / "died")
        got = [r for _, _, r in unordered_map(_dies_once, range(8), (marker,), 4, {},
                                              on_workers)]  # fmt: skip
        assert os.path.exists(marker) and len(got) == 8
        assert len(workers.processes) == 3
        # a worker's error reaches the driver as itself: one line
        with pytest.raises(RamDistError, match=r"^tensor 'x' in item \d: bad$"):
            list(unordered_map(_refuses, range(4), (), 4, {}, on_workers))
    finally:
        workers.close()
    once = GpuWorkers(1, restarts=0)
    try:
        with pytest.raises(RamDistError, match=r"^a GPU worker \(node \w+\) died and was not "
                           r"replaced after 0 restart\(s\)"):  # fmt: skip
            list(unordered_map(_dies, range(2), (), 2, {}, Routing(gpu=once, on_gpu=_all)))
    finally:
        once.close()


def _merged(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def test_auto_keeps_fused_work_on_the_cpus(inputs, fake_gpus, tmp_path):
    import jsonschema
    import torch
    from builders import load_checkpoint
    from reference import reference_merge

    from ram_dist.api import run_merge
    from ram_dist.engine import driver, worker

    # called inline (this process is Ray's driver, not a task): CUDA whenever it is there
    assert worker.given_gpus() is None
    assert worker.device() == ("cuda" if torch.cuda.is_available() else "cpu")
    schema = json.loads((Path(driver.__file__).parents[1] / "report_schema.json").read_text())
    base, tasks = inputs
    states = [load_checkpoint(p) for p in [base, *tasks]]
    expected, _ = reference_merge(states[0], states[1:], "ram_plus")
    shards, reports = {}, {}
    for device in ("auto", "cpu", "cuda"):
        out = tmp_path / device
        report = run_merge(_config(inputs, out, device=device, unit_budget_bytes=UNIT)).data
        jsonschema.Draft202012Validator(schema).validate(report)
        merged = load_checkpoint(out)
        assert merged.keys() == expected.keys()
        assert all(torch.equal(merged[k], v) for k, v in expected.items())
        shards[device], reports[device] = _merged(out), report
    assert shards["auto"] == shards["cpu"] == shards["cuda"]
    elements = sum(v.numel() for v in expected.values())
    for device in ("auto", "cpu"):  # every unit on the CPU slots, with the fused kernels
        report = reports[device]
        assert report["device"]["device"] == "cpu" and report["device"]["gpus"] == 0
        for stats in report["passes"].values():
            assert stats["units"] >= 40 and stats["units_on_cpu"] == stats["units"], stats
            assert stats["units_on_gpu"] == stats["tasks_on_gpu"] == 0
            assert stats["gpu_worker_processes"] == 0 and stats["gpu_busy_share"] is None
            assert stats["worker_processes"] <= 2
        assert report["passes"]["map"]["fused_elements"] == elements
        assert report["device"]["gpu_worker_processes"] == 0
    assert reports["auto"]["device"]["reason"].startswith("auto: the fused CPU kernels take")
    cuda = reports["cuda"]  # the eager rule on the GPU workers: the same bytes
    assert cuda["passes"]["map"]["fused_elements"] == 0
    assert cuda["device"]["gpu_worker_processes"] == 2
    for stats in cuda["passes"].values():
        assert stats["units_on_gpu"] == stats["units"] and stats["units_on_cpu"] == 0
        assert 0 < stats["gpu_busy_share"] <= 1
    text = (tmp_path / "auto" / "merge_report.json").read_text()
    assert json.loads(text)["device"] == reports["auto"]["device"]


def test_rescaled_ties_on_the_gpus_starts_two_processes_for_the_whole_job(
    inputs, fake_gpus, tmp_path
):
    from ram_dist.api import run_merge

    """`--device auto` picks cuda for this merge on this cluster (`ram-dist plan` says so in
    test_plan_says_the_device; an `auto` merge that runs on the GPU workers is
    test_auto_sends_lora_products_to_the_gpus'), so it is not merged a third time here."""
    params = {"density": 0.5, "rescale": True}
    shards, reports = {}, {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        config = _config(
            inputs, out, device=device, unit_budget_bytes=UNIT, method="ties",
            parameters=params,
        )  # fmt: skip
        reports[device] = run_merge(config).data
        shards[device] = _merged(out)
    assert shards["cuda"] == shards["cpu"]
    report = reports["cuda"]
    assert report["device"]["device"] == "cuda", report["device"]
    assert report["device"]["gpu_worker_processes"] <= 2  # not one per unit
    reduce, map_ = report["passes"]["reduce"], report["passes"]["map"]
    assert map_["units"] >= 40 and map_["units_on_gpu"] == map_["units"]
    assert reduce["units_on_gpu"] == reduce["units"]  # the NaN/Inf check round
    assert map_["worker_processes_started"] == 0  # the reduce pass's, kept
    assert len(map_["gpu_ids"]) == 2
    assert reports["cpu"]["passes"]["map"]["units_on_gpu"] == 0


def _adapter(folder: Path, rank: int = 4) -> Path:
    """A LoRA adapter of `inputs`' base that touches `a.weight` [128, 32] only."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(5)
    factors = {
        "base_model.model.a.lora_A.weight": torch.randn(rank, 32, generator=g) * 0.1,
        "base_model.model.a.lora_B.weight": torch.randn(128, rank, generator=g) * 0.02,
    }
    save_file(factors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["a"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_auto_sends_lora_products_to_the_gpus(inputs, fake_gpus, tmp_path):
    """A LoRA task's products are compute, not storage: with `auto` their units go to the GPU
    workers, which make them with torch (on the CPU here), with the bytes of `--device cpu`'s
    numba kernel; the tensors no adapter touches stay on the CPUs where the cluster has
    CPUs to spare."""
    from ram_dist.api import run_merge
    from ram_dist.engine.gpu import GpuWorkers
    from ram_dist.engine.pool import Routing, unordered_map
    from ram_dist.planning.job import prepare
    from ram_dist.planning.units import Piece, WorkUnit

    base, tasks = inputs
    lora_inputs = (base, [_adapter(tmp_path / "adapter"), tasks[1]])
    split = prepare(_config(lora_inputs)).device_choice(gpus=2, cpus=8)
    assert split.device == "cpu+cuda" and split.reason.startswith(
        "auto: 1 of 3 merged tensors have LoRA products to compute: their units on the GPUs"
    )
    units = {
        t: WorkUnit(0, "model.safetensors", (Piece(t, 0, 4),)) for t in ("a.weight", "c.weight")
    }
    assert split.on_gpu([units["a.weight"]]) and not split.on_gpu([units["c.weight"]])
    shards, reports = {}, {}
    for device in ("auto", "cpu"):
        out = tmp_path / device
        reports[device] = run_merge(
            _config(lora_inputs, out, device=device, unit_budget_bytes=UNIT)
        ).data
        shards[device] = _merged(out)
    assert shards["auto"] == shards["cpu"]
    auto, cpu = reports["auto"], reports["cpu"]
    # two CPUs, held by the two GPU workers: every unit on the GPUs
    assert (
        auto["device"]["device"] == "cuda"
        and "have LoRA products to compute" in auto["device"]["reason"]
    )
    for stats in auto["passes"].values():
        assert stats["units"] >= 20 and stats["units_on_gpu"] == stats["units"], stats
        assert stats["units_on_cpu"] == 0 and 0 < stats["gpu_busy_share"] <= 1
    assert auto["passes"]["map"]["fused_elements"] == 0  # the eager rule, on the GPU workers
    for stats in cpu["passes"].values():
        assert stats["units_on_gpu"] == 0 and stats["units_on_cpu"] == stats["units"]

    def _products_on(item: int) -> str | None:
        from ram_dist.kernels import lora

        return lora.computing_on()

    workers = GpuWorkers(1)  # a GPU worker makes its products with torch, on its device
    try:
        routing = Routing(gpu=workers, on_gpu=lambda item: True)
        assert [r for _, _, r in unordered_map(_products_on, range(1), (), 1, {}, routing)] == [
            "cpu"
        ]
    finally:
        workers.close()


def test_plan_says_the_device(inputs, fake_gpus, tmp_path, capsys):
    from ram_dist.api import run_plan
    from ram_dist.cli import main
    from ram_dist.planning.job import prepare

    planned = run_plan(_config(inputs, tmp_path / "p")).data
    choice = prepare(_config(inputs)).device_choice(2, 2)
    assert planned["device"] == {
        **choice.as_dict(),
        "cluster": "the Ray this process is connected to",
    }
    base, tasks = inputs
    argv = ["plan", "--base", str(base), *[a for t in tasks for a in ("--task", str(t))]]
    assert main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "device: cpu (--device cpu: one unit per CPU (2); its 2 GPU(s) stay idle)" in printed
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "device: cpu (auto: the fused CPU kernels take every merged tensor" in printed
    assert main([*argv, "--method", "ties", "--density", "0.5", "--rescale"]) == 0
    printed = capsys.readouterr().out
    assert "device: cuda (auto: 3 of 3 merged tensors need the eager rule (ties" in printed
    assert not (tmp_path / "p").exists()


def test_cuda_on_a_ray_without_gpus_exits_2_before_anything_runs(cuda_refused):
    run, out = cuda_refused
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("ram-dist: error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("ram-dist: error: --device cuda, but the Ray cluster has no GPU")
    assert not out.exists()  # nothing written, not even the output folder
