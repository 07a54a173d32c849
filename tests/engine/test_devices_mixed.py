"""`--device auto` on a cluster with more CPUs than GPUs, for a job with tensors of both
kinds: the units of the float64 tensor (the eager rule: the spec computes it in float64) go
to the GPU worker, the others to the CPUs it leaves, with the fused kernels, and the bytes are
those of a CPU-only run and of the reference. A real local Ray: 3 CPUs and a fake GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def fake_gpu(own_ray):
    from conftest import local_ray

    with local_ray(num_cpus=3, num_gpus=1):
        yield


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[Path]]:
    """bf16 tensors around a float64 one, a base and two tasks."""
    import torch
    from builders import save_shifted_tasks

    root = tmp_path_factory.mktemp("mixed")
    g = torch.Generator().manual_seed(3)
    base = {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(32, 32, generator=g).to(torch.float64),
        "c.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }
    return save_shifted_tasks(root, base, (0.2, 0.5), 0.125, g)


def test_eager_units_on_the_gpu_the_rest_on_the_cpus(inputs, fake_gpu, tmp_path):
    import torch
    from builders import load_checkpoint
    from reference import reference_merge

    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    base, tasks = inputs
    states = [load_checkpoint(p) for p in [base, *tasks]]
    expected, _ = reference_merge(states[0], states[1:], "ram_plus")
    shards, reports = {}, {}
    for device in ("auto", "cpu"):
        out = tmp_path / device
        config = MergeConfig(
            base=str(base), tasks=tuple(map(str, tasks)), out=str(out), device=device,
            unit_budget_bytes=1024,
        )  # fmt: skip
        reports[device] = run_merge(config).data
        merged = load_checkpoint(out)
        assert all(torch.equal(merged[k], v) for k, v in expected.items())
        shards[device] = (out / "model.safetensors").read_bytes()
    assert shards["auto"] == shards["cpu"]
    auto = reports["auto"]
    assert auto["device"]["device"] == "cpu+cuda"
    assert (auto["device"]["gpus"], auto["device"]["cpu_slots"]) == (1, 2)
    assert auto["device"]["reason"].startswith(
        "auto: 1 of 3 merged tensors need the eager rule (F64 tensors): their units on the GPUs"
    )
    b_units = 32 * 32 * 8 // 1024  # the float64 tensor's units, at 1 KiB a unit
    for stats in auto["passes"].values():
        assert stats["units_on_gpu"] == b_units, stats
        assert stats["units_on_cpu"] == stats["units"] - b_units > 0
        assert stats["gpu_worker_processes"] == 1
    assert auto["passes"]["map"]["fused_elements"] == 2 * 64 * 32  # a and c, on the CPUs
    assert auto["device"]["gpu_worker_processes"] == 1
    assert reports["cpu"]["passes"]["map"]["units_on_gpu"] == 0


def test_adapter_tasks_on_the_gpu_workers_give_the_cpu_bytes(fake_gpu, tmp_path):
    """PEFT adapter tasks with `--device cuda`: the GPU worker reads the blocks (the LoRA
    products computed by its reader with torch, in the spec's fixed order) and merges them;
    the bytes are the CPU run's. With `auto`, the units of the tensors the adapters change
    go to the GPU worker and the others to the CPUs it leaves: the same bytes."""
    from builders import build_tiny_base
    from peft_adapters import build_adapter

    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    base = tmp_path / "base"
    build_tiny_base(base, kind="llama")
    tasks = [
        build_adapter(base, tmp_path / "one", target_modules=("q_proj", "down_proj"), seed=1),
        build_adapter(base, tmp_path / "two", r=2, target_modules=("embed_tokens",), seed=2),
    ]
    shards = {}
    for device in ("cuda", "auto", "cpu"):
        out = tmp_path / device
        config = MergeConfig(
            base=str(base), tasks=tuple(map(str, tasks)), out=str(out), device=device,
            unit_budget_bytes=4096,
        )  # fmt: skip
        report = run_merge(config).data
        assert report["device"]["device"] == ("cpu+cuda" if device == "auto" else device)
        shards[device] = (out / "model.safetensors").read_bytes()
        if device == "auto":
            assert "merged tensors have LoRA products to compute" in report["device"]["reason"]
            for stats in report["passes"].values():
                assert 0 < stats["units_on_gpu"] < stats["units"], stats
    assert shards["cuda"] == shards["auto"] == shards["cpu"]
