"""On a machine with CUDA: every method of the registry (`support/method_cases.py`, with the
switches that make a method compute on whole rows) gives the same bytes on the GPU workers
(`--device cuda`, the eager rule on the GPU) as on the CPUs, fused (`--device cpu`, the
kernels where they apply) and eager (`--kernels eager`, on the mixed set): for bf16, fp16,
fp32 and mixed inputs; on fine-grained FP8 inputs (a method whose kernels write FP8, one
whose kernels read it and leave the engine to requantize, and one whose rounds take it
decoded: `FP8_METHODS`; test_fp8_checkpoints.py runs every method on them on the CPU); on
MXFP4, packed INT4 and per-channel FP8 bases (every method on one of them); and with PEFT
LoRA adapters as tasks (their products on the GPU).

Skipped without CUDA: the scheduling is tested with fake GPUs in `tests/engine/test_devices.py`
and `tests/engine/test_devices_mixed.py`, where the GPU workers compute on the CPU and so
cannot tell whether CUDA rounds as the CPU does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import DTYPE_SETS, build_model_set
from method_cases import case_id, case_parameters, every_method, task_count

from ram_dist.methods.registry import METHODS

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False here): it compares the "
    "GPU's bytes with the CPU's; fake GPUs test the scheduling in tests/engine/test_devices.py",
)

#: One row of a 64-wide bf16 tensor is 128 bytes: many units a tensor.
BUDGET = 64 * 2**10
#: The FP8 cases: the first method whose kernels read FP8 as stored and write it
#: (`writes_fp8`), the first that reads it as stored and leaves the engine to requantize, and
#: model_stock, whose fused round declines the stored form (its exact sums take decoded
#: values) while its map pass's kernel reads it as stored (`reads_stored`).
FP8_METHODS = [
    next(n for n, m in METHODS.items() if getattr(m, "writes_fp8", False)),
    next(n for n, m in METHODS.items()
         if getattr(m, "reads_stored", False) and not getattr(m, "writes_fp8", False)),
    "model_stock",
]  # fmt: skip


def _merged(base: Path, tasks, out: Path, device: str, kernels: str, **kw) -> dict[str, bytes]:
    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    config = MergeConfig(
        base=str(base), tasks=tuple(map(str, tasks)), out=str(out), device=device,
        kernels=kernels, unit_budget_bytes=BUDGET, **kw,
    )  # fmt: skip
    report = run_merge(config).data
    on_gpu = report["passes"]["map"]["units_on_gpu"]
    assert on_gpu == (report["passes"]["map"]["units"] if device == "cuda" else 0)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _gpu_gives_the_cpus_bytes(base, tasks, tmp_path: Path, cpu_kernels, **kw) -> None:
    gpu = _merged(base, tasks, tmp_path / "cuda", "cuda", "auto", **kw)
    assert gpu
    for kernels in cpu_kernels:
        cpu = _merged(base, tasks, tmp_path / f"cpu-{kernels}", "cpu", kernels, **kw)
        assert gpu == cpu, f"the GPU's bytes are not the CPU's ({kernels})"


@pytest.fixture(scope="module")
def model_sets(tmp_path_factory) -> dict:
    return {
        name: build_model_set(tmp_path_factory.mktemp(name), **spec)
        for name, spec in DTYPE_SETS.items()
    }


@pytest.mark.parametrize("dtypes", list(DTYPE_SETS))
@pytest.mark.parametrize("case", every_method(rows=True), ids=case_id)
def test_every_method_gives_the_cpus_bytes(ray_local, model_sets, tmp_path, dtypes, case):
    method, params = case
    base, tasks = model_sets[dtypes][:2]
    tasks = tasks[: task_count(method, len(tasks))]
    kernels = ("auto", "eager") if dtypes == "mixed" else ("auto",)
    _gpu_gives_the_cpus_bytes(base, tasks, tmp_path, kernels, method=method, parameters=params)


@pytest.mark.parametrize("method", FP8_METHODS)
def test_fp8_inputs_give_the_cpus_bytes(ray_local, tmp_path, method):
    from fp8_models import build_fp8_set

    s = build_fp8_set(tmp_path / "in", task_formats=("fp8", "fp8", "bf16"))
    tasks = s.task_dirs[: task_count(method, len(s.task_dirs))]
    _gpu_gives_the_cpus_bytes(
        s.base_dir, tasks, tmp_path, ("auto", "eager"), method=method,
        parameters=case_parameters(method),
    )  # fmt: skip


def test_lora_adapters_give_the_cpus_bytes(ray_local, tmp_path):
    """Two PEFT adapters (one with an embedding, rank and alpha patterns) and a full
    checkpoint as tasks: the adapters' products on the GPU give the CPU's bytes, with every
    unit on the GPU workers and with `auto`, which sends the units of the tensors the
    adapters change there (torch makes their products on the GPU)."""
    from builders import build_tiny_base, make_task_state, save_checkpoint
    from peft_adapters import build_adapter

    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    base_dir = tmp_path / "base"
    base = build_tiny_base(base_dir, kind="llama", dtype=torch.bfloat16)
    tasks = [
        build_adapter(base_dir, tmp_path / "adapter0", r=4, lora_alpha=8,
                      target_modules=("q_proj", "v_proj"), seed=1),
        build_adapter(base_dir, tmp_path / "adapter1", r=8, lora_alpha=16,
                      target_modules=("embed_tokens", "q_proj", "up_proj", "down_proj"),
                      rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 4}, seed=2),
        tmp_path / "full",
    ]  # fmt: skip
    save_checkpoint(make_task_state(base, 0.3, seed=7), tasks[2], copy_from=base_dir)
    _gpu_gives_the_cpus_bytes(base_dir, tasks, tmp_path, ("auto", "eager"))
    out = tmp_path / "auto"
    config = MergeConfig(base=str(base_dir), tasks=tuple(map(str, tasks)), out=str(out),
                         unit_budget_bytes=BUDGET)  # fmt: skip
    report = run_merge(config).data
    assert "have LoRA products to compute" in report["device"]["reason"]
    assert report["passes"]["map"]["units_on_gpu"] > 0
    cpu, written = tmp_path / "cpu-auto", sorted(out.glob("*.safetensors"))
    assert written and all(p.read_bytes() == (cpu / p.name).read_bytes() for p in written)


#: The quantized bases: gpt-oss's MXFP4 and compressed-tensors' packed INT4 and FP8 per
#: channel, each with bf16 agents trained from it.
QUANTIZED = ("mxfp4", "int", "fp8")


@pytest.fixture(scope="module")
def quantized_sets(tmp_path_factory) -> dict:
    from compressed_models import FP8_SCHEMES, INT_SCHEMES
    from compressed_models import build_set as build_compressed
    from mxfp4_models import build_set as build_gptoss

    gptoss = build_gptoss(tmp_path_factory.mktemp("mxfp4"))
    ints = build_compressed(tmp_path_factory.mktemp("int"), INT_SCHEMES)
    fp8 = build_compressed(tmp_path_factory.mktemp("fp8"), FP8_SCHEMES)
    return {
        name: (s.base_dir, s.agent_dirs)
        for name, s in (("mxfp4", gptoss), ("int", ints), ("fp8", fp8))
    }


def _rotated() -> list:
    """Every method's case once, the quantized formats taken in turn (each format meets a
    third of the registry, fused and eager methods alike): the decoding is the format's."""
    cases = every_method(rows=True)
    return [(QUANTIZED[i % len(QUANTIZED)], case) for i, case in enumerate(cases)]


@pytest.mark.parametrize(
    ("fmt", "case"), _rotated(), ids=lambda v: v if isinstance(v, str) else case_id(v)
)
def test_quantized_bases_give_the_cpus_bytes(ray_local, quantized_sets, tmp_path, fmt, case):
    """Each method on a quantized base: the GPU decodes it as the CPU's kernels do."""
    method, params = case
    base, tasks = quantized_sets[fmt]
    tasks = tasks[: task_count(method, len(tasks))]
    _gpu_gives_the_cpus_bytes(
        base, tasks, tmp_path, ("auto", "eager"), method=method, parameters=params
    )
