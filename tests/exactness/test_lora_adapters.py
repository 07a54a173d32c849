"""PEFT LoRA adapters as tasks (issue 33), end to end on a real local Ray.

Adapters written by PEFT itself (`peft_adapters.py`) are given to ram-dist as tasks, mixed
with a full checkpoint. Each merge's bytes must equal the same merge with every adapter
replaced by its full checkpoint as the spec defines it (base + delta, rounded to the base's
dtype), written by the independent reference (`lora_reference.materialize`); and, for RAM,
RAM+ and RAM+s, the whole-tensor reference merge (`reference.reference_merge`) of the
reference's task states. Every method, unit budgets from a few rows to whole tensors, the
fused and the eager path; every adapter form PEFT writes; a merged output that transformers
loads and runs.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from builders import (
    assert_same_bytes,
    build_tiny_base,
    load_checkpoint,
    make_task_state,
    save_checkpoint,
)
from fp8_models import quantize_checkpoint
from fp8_reference import FP8, SCALE, quantize, reference_fp8_merge, values
from lora_reference import adapter_task_state, load_state, materialize
from peft_adapters import (
    ADAPTER_FORMS,
    build_adapter,
    build_tiny_bases,
    merge_with_peft,
)
from reference import reference_merge
from safetensors.torch import save_file

from ram_dist.api import run_merge
from ram_dist.methods.registry import METHODS
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

RAM_METHODS = ["ram", "ram_plus", "ram_plus_soft"]
#: Parameters that make each baseline select or draw (density < 1), so that a unit cut or a
#: task order that differs would show.
PARAMETERS = {
    "ties": {"density": 0.5},
    "dare_ties": {"density": 0.5, "seed": 3},
    "dare_linear": {"density": 0.5, "seed": 3},
    "task_arithmetic": {"lambda": 0.8},
    "breadcrumbs": {"density": 0.5, "gamma": 0.05},
    "breadcrumbs_ties": {"density": 0.5, "gamma": 0.05, "rescale": True},
    "della": {"density": 0.5, "epsilon": 0.1, "seed": 3},
    "della_linear": {"density": 0.5, "epsilon": 0.1, "seed": 3},
    "sce": {"select_topk": 0.5},
    "nearswap": {"t": 0.01},
    "slerp": {"t": 0.3},
    "nuslerp": {"weight": 0.6},
    "multislerp": {"weight": 0.6},
}
#: Two bf16 rows of 64 per unit (about 800 units), 8 rows, whole tensors.
BUDGETS = [300, 1024, 256 * 2**20]


def _merge(base, tasks, out, **kw) -> dict:
    config = MergeConfig(base=str(base), tasks=tuple(str(t) for t in tasks), out=str(out), **kw)
    return run_merge(config).data


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.suffix == ".safetensors" or p.name.endswith("index.json")
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """A tiny bf16 Llama base (sharded by transformers), two PEFT adapters (q/v at r 4;
    an embedding, MLP and modules_to_save adapter at r 8, rank and alpha patterns), one full
    checkpoint agent, the reference's full checkpoints of the two adapters, and the adapters
    merged by PEFT's merge_and_unload()."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base = build_tiny_base(base_dir, kind="llama", dtype=torch.bfloat16, max_shard_size="100KB")
    adapters = [
        build_adapter(base_dir, root / "adapter0", r=4, lora_alpha=8,
                      target_modules=("q_proj", "v_proj"), seed=1),
        build_adapter(base_dir, root / "adapter1", r=8, lora_alpha=16,
                      target_modules=("embed_tokens", "q_proj", "up_proj", "down_proj"),
                      rank_pattern={"down_proj": 2}, alpha_pattern={"q_proj": 4},
                      modules_to_save=("lm_head",), seed=2),
    ]  # fmt: skip
    full = make_task_state(base, 0.3, seed=7)
    save_checkpoint(full, root / "full", copy_from=base_dir)
    materialized = [
        materialize(base_dir, a, root / f"materialized{i}") for i, a in enumerate(adapters)
    ]
    for i, adapter in enumerate(adapters):
        merge_with_peft(base_dir, adapter, root / f"peft{i}")
    return {
        "base_dir": base_dir,
        "base": base,
        "adapter_tasks": [*adapters, root / "full"],
        "full_tasks": [root / "materialized0", root / "materialized1", root / "full"],
        "states": [*materialized, full],
        "peft_tasks": [root / "peft0", root / "peft1", root / "full"],
        "expected": {},  # method -> digest of the merge of the full checkpoints
        "merged": {},  # method -> the folder of its merge of the adapter tasks
    }


def _taken(method: str, tasks: list[Path]) -> list[Path]:
    """As many of the tasks as the method merges (nearswap, arcee_fusion, passthrough: the
    first, an adapter)."""
    most = METHODS[method].task_counts[1]
    return tasks if most is None else tasks[:most]


def _expected_digest(job: dict, method: str, tmp_path: Path) -> dict[str, str]:
    """The merge of the reference's full checkpoints, once per method."""
    if method not in job["expected"]:
        out = tmp_path / "full-merge"
        _merge(job["base_dir"], _taken(method, job["full_tasks"]), out, method=method,
               parameters=PARAMETERS.get(method, {}))  # fmt: skip
        job["expected"][method] = _digest(out)
        if method in RAM_METHODS:
            expected, _ = reference_merge(job["base"], job["states"], method)
            assert_same_bytes(load_checkpoint(out), expected)
    return job["expected"][method]


def _adapter_merge(job: dict, method: str) -> Path:
    """The method's merge of the adapter tasks in units of 4096 bytes, once per method (in
    the module's folder)."""
    if method not in job["merged"]:
        out = job["base_dir"].parent / f"merged-{method}"
        _merge(job["base_dir"], _taken(method, job["adapter_tasks"]), out, method=method,
               parameters=PARAMETERS.get(method, {}), unit_budget_bytes=4096)  # fmt: skip
        job["merged"][method] = out
    return job["merged"][method]


def test_reference_states_are_the_adapters_merged(job):
    """The materialized checkpoints are what adapter_task_state gives, and they changed."""
    base = job["base"]
    for adapter, state in zip(job["adapter_tasks"][:2], job["states"][:2], strict=True):
        assert_same_bytes(state, adapter_task_state(base, adapter))
        changed = [n for n in base if not torch.equal(state[n], base[n])]
        assert len(changed) >= 4


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_merges_adapters_as_their_full_checkpoints(job, tmp_path, method):
    out = _adapter_merge(job, method)
    assert _digest(out) == _expected_digest(job, method, tmp_path)


@pytest.mark.parametrize(
    ("method", "budget", "kernels"),
    [
        ("ram_plus", BUDGETS[0], "auto"),
        ("ram_plus", BUDGETS[1], "auto"),
        ("ram_plus", BUDGETS[1], "eager"),
        ("ram_plus", BUDGETS[2], "eager"),
        ("ties", 4096, "eager"),
        ("ties", BUDGETS[2], "auto"),
    ],
)
def test_budgets_and_paths_do_not_change_bytes(job, tmp_path, method, budget, kernels):
    out = tmp_path / "out"
    report = _merge(job["base_dir"], job["adapter_tasks"], out, method=method,
                    parameters=PARAMETERS.get(method, {}), unit_budget_bytes=budget,
                    kernels=kernels)  # fmt: skip
    assert _digest(out) == _expected_digest(job, method, tmp_path)
    if kernels == "eager":
        assert report["passes"]["map"]["fused_elements"] == 0


@pytest.fixture(scope="module")
def form_bases(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_bases(tmp_path_factory.mktemp("form-bases"))


@pytest.mark.parametrize("form", list(ADAPTER_FORMS))
def test_every_adapter_form_against_the_reference(form_bases, tmp_path, form):
    """Each form PEFT writes (ranks, alphas, rslora, patterns, an embedding, modules_to_save,
    lora_bias, fan_in_fan_out on GPT-2's Conv1D, a bf16 adapter), two of it beside a full
    checkpoint, merged by RAM+ in units of a few rows: the reference merge's bytes."""
    kind, kwargs = ADAPTER_FORMS[form]
    base_dir = form_bases[kind]
    base = load_checkpoint(base_dir)
    adapters = [build_adapter(base_dir, tmp_path / f"a{i}", **kwargs, seed=i) for i in (1, 2)]
    full = make_task_state(base, 0.3, seed=7)
    save_checkpoint(full, tmp_path / "full", copy_from=base_dir)
    states = [adapter_task_state(base, a) for a in adapters] + [full]
    _merge(base_dir, [*adapters, tmp_path / "full"], tmp_path / "out", method="ram_plus",
           unit_budget_bytes=2048)  # fmt: skip
    expected, _ = reference_merge(base, states, "ram_plus")
    assert_same_bytes(load_checkpoint(tmp_path / "out"), expected)


def test_merged_output_loads_and_runs_in_transformers(job, tmp_path):
    from transformers import AutoModelForCausalLM

    out = _adapter_merge(job, "ram_plus")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[1, 17, 42, 99]])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
    assert torch.isfinite(model(ids).logits).all()


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of x's dtype at each of its values (subnormal spacing below the smallest
    normal and at 0), in float64."""
    info = torch.finfo(x.dtype)
    emin = int(math.log2(info.tiny))
    v = x.double().abs()
    _, e = torch.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    e = torch.where(v == 0, torch.full_like(e, emin + 1), e) - 1
    return torch.exp2((e.clamp(min=emin) + math.log2(info.eps)).double())


@pytest.mark.parametrize(("method", "factor"), [("ram_plus", 1.2), ("task_arithmetic", 0.8),
                                                ("linear", 1.0)])  # fmt: skip
def test_peft_merged_checkpoints_agree_within_one_rounding(job, tmp_path, method, factor):
    """The adapters merged by PEFT's merge_and_unload() and given as full checkpoints: the
    merge agrees with the adapter merge per element within `factor` (the largest weight a
    task vector gets: RAM+'s lambda at most 1 + r * alpha, task_arithmetic's lambda, linear's
    weight) times the tasks' gaps, plus one rounding of the output's dtype on each side.
    Where no task's value differs, the bytes are the same."""
    _merge(job["base_dir"], job["peft_tasks"], tmp_path / "peft", method=method,
           parameters=PARAMETERS.get(method, {}))  # fmt: skip
    ours = load_checkpoint(_adapter_merge(job, method))
    theirs = load_checkpoint(tmp_path / "peft")
    peft_states = [load_state(t) for t in job["peft_tasks"]]
    differ = 0
    for name, a in ours.items():
        b = theirs[name]
        gaps = sum((o[name].double() - p[name].double()).abs()
                   for o, p in zip(job["states"], peft_states, strict=True))  # fmt: skip
        gap = (a.double() - b.double()).abs()
        bound = factor * gaps + _ulp(a) + _ulp(b)
        assert bool((gap <= bound).all()), name
        assert bool((gap[gaps == 0] == 0).all()), name
        differ += int((gap != 0).sum())
    assert differ > 0  # PEFT's embedding merge rounds twice: some elements do differ


@pytest.fixture(scope="module")
def fp8_job(tmp_path_factory) -> dict:
    """The tiny Llama made fine-grained FP8 (blocks 16 x 24, ragged), two adapters PEFT built
    on its bf16 twin (same names and shapes), one FP8 agent changing 30 % of the elements."""
    root = tmp_path_factory.mktemp("lora-fp8")
    build_tiny_base(root / "bf16", kind="llama", dtype=torch.bfloat16)
    block = (16, 24)
    base = quantize_checkpoint(root / "bf16", root / "base", block)
    adapters = [
        build_adapter(root / "bf16", root / "adapter0", r=4, lora_alpha=8,
                      target_modules=("q_proj", "down_proj"), seed=1),
        build_adapter(root / "bf16", root / "adapter1", r=2, lora_alpha=5,
                      target_modules=("q_proj", "embed_tokens", "gate_proj"), seed=2),
    ]  # fmt: skip
    g = torch.Generator().manual_seed(5)
    full: dict[str, torch.Tensor] = {}
    for name, x in values(base, block).items():
        moved = torch.rand(x.shape, generator=g) < 0.3
        y = torch.where(moved, x.float() + torch.randn(x.shape, generator=g) * 0.01, x.float())
        if base[name].dtype == FP8:
            full[name], full[name + SCALE] = quantize(y, block)
        else:
            full[name] = y.to(base[name].dtype)
    (root / "full").mkdir()
    save_file(full, str(root / "full" / "model.safetensors"), {"format": "pt"})
    (root / "full" / "config.json").write_bytes((root / "base" / "config.json").read_bytes())
    states = [
        materialize(root / "base", a, root / f"materialized{i}") for i, a in enumerate(adapters)
    ]
    return {
        "base_dir": root / "base",
        "base": base,
        "block": block,
        "adapter_tasks": [*adapters, root / "full"],
        "full_tasks": [root / "materialized0", root / "materialized1", root / "full"],
        "states": [*states, full],
    }


@pytest.mark.parametrize(("method", "budget"), [("ram_plus", 1024), ("ram", 256 * 2**20),
                                                ("task_arithmetic", 1024)])  # fmt: skip
def test_adapters_on_an_fp8_base(fp8_job, tmp_path, method, budget):
    """An adapter's FP8 weights are its dequantized values plus the delta, rounded to bf16;
    the output is FP8 again: the reference FP8 merge's bytes, and the merge of the full
    checkpoints (FP8 and bf16 weights mixed) the reference writes."""
    params = PARAMETERS.get(method, {})
    _merge(fp8_job["base_dir"], fp8_job["adapter_tasks"], tmp_path / "out", method=method,
           parameters=params, unit_budget_bytes=budget)  # fmt: skip
    _merge(fp8_job["base_dir"], fp8_job["full_tasks"], tmp_path / "full", method=method,
           parameters=params, unit_budget_bytes=budget)  # fmt: skip
    assert _digest(tmp_path / "out") == _digest(tmp_path / "full")
    if method in RAM_METHODS:
        expected, _ = reference_fp8_merge(fp8_job["base"], fp8_job["states"], method,
                                          fp8_job["block"])  # fmt: skip
        assert_same_bytes(load_state(tmp_path / "out"), expected)


def test_mergekit_yaml_base_plus_adapter(job, tmp_path, monkeypatch):
    """mergekit's `model: ./base+./adapter` (the part before `+` the job's base model), with
    relative paths as mergekit writes them: the same bytes as the full checkpoints' merge."""
    from ram_dist.api import merge

    root = job["base_dir"].parent
    monkeypatch.chdir(root)
    config = tmp_path / "merge.yaml"
    config.write_text(
        "merge_method: ram_plus\n"
        "base_model: ./base\n"
        "models:\n"
        "  - model: ./base+./adapter0\n"
        "  - model: ./base+./adapter1\n"
        "  - model: ./full\n"
    )
    merge(config=config, out=tmp_path / "out")
    assert _digest(tmp_path / "out") == _expected_digest(job, "ram_plus", tmp_path)


@pytest.mark.parametrize(("kind", "dtype"), [("llama", torch.float32), ("qwen2", torch.float16)])
def test_float32_and_float16_bases_pin_the_fixed_order(tmp_path, monkeypatch, kind, dtype):
    """On a float32 base every float32 rounding of the delta shows in the output: rank-16
    adapters merged in units of a few rows equal the reference's fixed k-ascending order,
    and a matrix multiply's order (`B @ A`) would give other bytes."""
    import lora_reference

    base_dir = tmp_path / "base"
    base = build_tiny_base(base_dir, kind=kind, dtype=dtype)
    targets = ("q_proj", "down_proj", "embed_tokens")
    adapters = [
        build_adapter(base_dir, tmp_path / f"a{i}", r=16, lora_alpha=24, target_modules=targets,
                      seed=i)
        for i in (1, 2)
    ]  # fmt: skip
    full = make_task_state(base, 0.3, seed=7)
    save_checkpoint(full, tmp_path / "full", copy_from=base_dir)
    _merge(base_dir, [*adapters, tmp_path / "full"], tmp_path / "out", method="ram_plus",
           unit_budget_bytes=2048)  # fmt: skip
    merged = load_checkpoint(tmp_path / "out")
    states = [adapter_task_state(base, a) for a in adapters]
    expected, _ = reference_merge(base, [*states, full], "ram_plus")
    assert_same_bytes(merged, expected)
    monkeypatch.setattr(lora_reference, "fixed_order_product", lambda b, a: b.float() @ a.float())
    matmul_states = [adapter_task_state(base, a) for a in adapters]
    other, _ = reference_merge(base, [*matmul_states, full], "ram_plus")
    assert any(not torch.equal(other[n], merged[n]) for n in merged)
