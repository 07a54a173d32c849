"""Llama-4's `fbgemm_fp8` bases, 3-D experts included, merged end to end on a real local Ray
(spec: "Other quantized bases", `fbgemm_fp8`, and FP8 output "by the block rule's
analogue").

The inputs (`support/llama4_models.py`, which never imports ram_dist): a tiny Llama-4 built by
transformers whose decoder matrices are e4m3 with a float32 scale per row and whose experts
(`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]) are e4m3 with a float32 scale per expert
and column ([E, 1, 2I] and [E, H, 1], transformers' `FbgemmFp8Llama4TextExperts` layout);
agents in bf16 as trainers save them. The base's values and the FP8 output are written in the
support module from the spec.

1. Every method of the registry: the reference's bytes, written FP8 again (a group no task
   changed keeps the base's bytes and scale), fused at one expert a unit and eager on whole
   tensors.
2. `out_dtype` bfloat16: the bf16 Llama-4 (no quantization_config), which transformers loads
   and runs.
3. Refused before any work (exit 2, naming the tensor): an expert's scale of another shape
   or dtype, or none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, load_checkpoint, merge_config
from llama4_models import DOWN, GATE_UP, Llama4Set, build_set, fp8_output
from precision_sets import (
    PARAMETERS,
    RAM_FAMILY,
    TASK_WEIGHTS,
    WEIGHTED,
    InputSet,
    reference_for,
    tasks_for,
)
from safetensors.torch import load_file, save_file

from ram_dist.api import run_merge
from ram_dist.cli import main
from ram_dist.methods.registry import METHODS

BF16, F32 = torch.bfloat16, torch.float32
EPSILON = 1e-5
#: Bytes of one gate_up_proj expert in the agents ([64, 64] bf16): a unit holds one expert.
ONE_EXPERT = 64 * 64 * 2
WHOLE = 10**8

# One Ray for the module: every merge joins it rather than starting (and stopping) its own.
pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Llama4Set:
    return build_set(tmp_path_factory.mktemp("llama4"))


def _merge(s: Llama4Set, picked: list[int], out: Path, method: str, **kw) -> dict:
    parameters = {"epsilon": EPSILON} if method in RAM_FAMILY else PARAMETERS.get(method, {})
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(len(picked)))
    return run_merge(
        merge_config(s.base_dir, [s.agent_dirs[i] for i in picked], out, method=method,
                     parameters=parameters,
                     task_parameters=per_task if method in WEIGHTED else (), **kw)
    ).data  # fmt: skip


def _reference(s: Llama4Set, method: str) -> tuple[list[int], dict, dict | None]:
    picked = tasks_for(method)
    inputs = InputSet(
        base_dir=s.base_dir, task_dirs=[], base=s.base, x_base=dict(s.x_base),
        tasks=[s.agents[i] for i in picked], touched={}, block=None, row_budget=0,
        epsilon=EPSILON,
    )  # fmt: skip
    merged, stats = reference_for(method, inputs, list(range(len(picked))))
    return picked, merged, stats


def test_the_experts_are_stored_as_transformers_holds_them(llama4):
    """The inputs are what they claim: e4m3 experts with [E, 1, 2I] and [E, H, 1] float32
    scales, and the agents the base's values in bf16 where they changed nothing."""
    s = llama4
    assert s.base[GATE_UP].shape == (4, 64, 64) and s.base[GATE_UP + "_scale"].shape == (4, 1, 64)
    assert s.base[DOWN].shape == (4, 32, 64) and s.base[DOWN + "_scale"].shape == (4, 64, 1)
    # transformers' expert GEMM: down_proj[e].T [H, I] scaled per row by down_proj_scale[e]
    e = 2
    rows = s.base[DOWN][e].T.to(F32) * s.base[DOWN + "_scale"][e].reshape(-1, 1)
    assert torch.equal(rows.T, s.x_base[DOWN][e])
    for agent, masks in zip(s.agents, s.masks, strict=True):
        for name, x in s.x_base.items():
            assert torch.equal(agent[name] != x.to(BF16), masks[name]), name


@pytest.mark.parametrize("method", METHODS)
def test_every_method_merges_fbgemm_experts_exactly(llama4, tmp_path, method):
    s = llama4
    picked, merged, stats = _reference(s, method)
    expected = fp8_output(s, merged)
    for budget, kernels in ((ONE_EXPERT, "auto"), (WHOLE, "eager")):
        out = tmp_path / f"{budget}-{kernels}"
        report = _merge(s, picked, out, method, unit_budget_bytes=budget, kernels=kernels)
        got = load_checkpoint(out)
        assert_same_bytes(got, expected)
        if budget == ONE_EXPERT:  # a unit holds one expert: never more than two an input
            assert max(report["passes"]["map"]["max_unit_bytes_read_per_input"]) <= 2 * budget
        if method in RAM_FAMILY:
            assert [t["changed"] for t in report["tasks"]] == [
                sum(int(m.sum()) for m in s.masks[i].values()) for i in picked
            ]
            assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    if method not in RAM_FAMILY:  # a blend moves elements no agent changed
        return
    # an expert column no agent changed kept the base's bytes and scale
    untouched = ~torch.stack([s.masks[i][GATE_UP] for i in picked]).any(0).any(1)  # [E, C]
    assert bool(untouched.any())
    assert torch.equal(
        got[GATE_UP + "_scale"].reshape(4, 64)[untouched],
        s.base[GATE_UP + "_scale"].reshape(4, 64)[untouched],
    )


def test_out_dtype_bf16_is_the_bf16_llama4_and_runs(llama4, tmp_path):
    from transformers import AutoModelForCausalLM, Llama4ForCausalLM

    s = llama4
    picked, merged, _ = _reference(s, "ram_plus")
    out = tmp_path / "out"
    _merge(s, picked, out, "ram_plus", out_dtype="bfloat16")
    got = load_checkpoint(out)
    assert_same_bytes(got, {n: y.to(BF16) for n, y in merged.items()})
    assert got.keys() == load_checkpoint(s.bf16_dir).keys()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert isinstance(model, Llama4ForCausalLM) and model.dtype == BF16
    for name, p in model.state_dict().items():
        assert torch.equal(p.view(torch.int16), got[name].view(torch.int16)), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2, 77, 3, 4, 100]])).logits
    assert logits.shape == (1, 8, 128) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    "scale, why",
    [
        (torch.ones(4, 64, dtype=F32), "[4, 64]"),
        (torch.ones(4, 1, 32, dtype=F32), "[4, 1, 32]"),
        (torch.ones(4, 1, 64, dtype=BF16), "BF16 [4, 1, 64]"),
        (None, "has no"),
    ],
)
def test_an_expert_scale_of_another_shape_is_refused(llama4, tmp_path, capsys, scale, why):
    s = llama4
    base = tmp_path / "base"
    shutil.copytree(s.base_dir, base)
    state = load_file(str(base / "model.safetensors"))
    if scale is None:
        del state[GATE_UP + "_scale"]
    else:
        state[GATE_UP + "_scale"] = scale
    save_file(state, str(base / "model.safetensors"), {"format": "pt"})
    out = tmp_path / "out"
    argv = ["merge", "--base", str(base), "--out", str(out)]
    for task in s.agent_dirs[:2]:
        argv += ["--task", str(task)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    err = err[err.index("ram-dist: error: ") :]
    assert repr(GATE_UP + "_scale") in err and why in err and "base model" in err, err
    assert "Traceback" not in err and not out.exists()
