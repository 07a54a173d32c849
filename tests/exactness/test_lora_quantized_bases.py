"""PEFT LoRA adapters as tasks over a quantized base (issue 42, point 1), end to end on a real
local Ray: block FP8 (DeepSeek's layout, ragged 16 x 24 blocks), compressed-tensors' packed
INT4/INT8 (groups of 32 with packed zero points, per channel, per tensor with a float32
scale) and FP8 (per channel with bf16 scales, per tensor with float32 ones), and fbgemm_fp8
(a float32 scale per row), each with two adapters and a bf16 agent (`lora_quantized`).

The adapter tasks' values are written from the spec in `lora_quantized` (the base at the
task's precision, bf16, plus the delta, rounded to bf16; the base's value where the adapter
does nothing); every method's merge of those values by the independent references
(`precision_sets.reference_for`) is the expected output: every method fused over the INT
base in units of a few rows; RAM+ (in units of a row), TIES and linear over each base, fused
and eager on whole tensors. The LoRA kernel reads the base as
stored (`engine/test_lora_reads_stored.py` checks that no copy of it is decoded).

LoRA applies to matrices only: gpt-oss's MXFP4 weights are its experts ([E, ., .]) and
Llama-4's fbgemm_fp8 experts are 3-D, which an adapter cannot target (refused, and PEFT's
`target_parameters` is refused too: checked here for gpt-oss); gpt-oss's attention weights,
which adapters do target, are bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, load_checkpoint, merge_config
from lora_quantized import BF16, KINDS, LoraSet, build
from precision_sets import PARAMETERS, RAM_FAMILY, TASK_WEIGHTS, WEIGHTED, InputSet, reference_for

from ram_dist.api import run_merge
from ram_dist.methods.registry import METHODS

pytestmark = pytest.mark.usefixtures("ray_local")

#: Units of about a row of the widest weight (an FP8 block base's: a band), of a few rows,
#: and whole tensors.
ONE_ROW, ROWS, WHOLE = 256, 2048, 10**8
#: A method of each family with a fused map pass over a stored base (RAM's, TIES's, the
#: weighted sum's).
SOME = ("ram_plus", "ties", "linear")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Each kind's set, built the first time a test asks for it (one bf16 twin and its two
    adapters for every kind)."""
    built: dict[str, LoraSet] = {}
    shared = tmp_path_factory.mktemp("twin")

    def get(kind: str) -> LoraSet:
        if kind not in built:
            built[kind] = build(kind, tmp_path_factory.mktemp(kind), shared)
        return built[kind]

    return get


@pytest.fixture(scope="module")
def expected():
    """The reference merge of a set's tasks' values by the spec, every tensor in bfloat16:
    computed once per set and method."""
    merges: dict[tuple[Path, str], dict] = {}

    def get(s: LoraSet, method: str, picked: list[int]) -> dict:
        if (s.base_dir, method) not in merges:
            inputs = InputSet(
                base_dir=s.base_dir, task_dirs=[], base={}, x_base=dict(s.x_base),
                tasks=s.tasks, touched={}, block=None, row_budget=0,
            )  # fmt: skip
            merged, _ = reference_for(method, inputs, picked)
            merges[s.base_dir, method] = {n: y.to(BF16) for n, y in merged.items()}
        return merges[s.base_dir, method]

    return get


def _check(s: LoraSet, expected, method: str, out: Path, budget: int, kernels: str) -> None:
    """The merge of the adapters and the agent, every tensor in bfloat16: the reference
    merge of the tasks' values by the spec (`expected`)."""
    picked = [0, 1, 2][: METHODS[method].task_counts[1] or 3]
    parameters = {"epsilon": 1e-5} if method in RAM_FAMILY else PARAMETERS.get(method, {})
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(len(picked)))
    run_merge(
        merge_config(s.base_dir, [s.task_dirs[i] for i in picked], out, method=method,
                     parameters=parameters, task_parameters=per_task if method in WEIGHTED else (),
                     unit_budget_bytes=budget, kernels=kernels, out_dtype="bfloat16")
    )  # fmt: skip
    assert_same_bytes(load_checkpoint(out), expected(s, method, picked))


@pytest.mark.parametrize("kind", KINDS)
def test_the_adapters_change_quantized_weights(sets, kind):
    """The inputs have teeth: each adapter changes quantized weights."""
    s = sets(kind)
    for task in s.tasks[:2]:
        changed = [n for n in s.quantized if not torch.equal(task[n].float(), s.x_base[n].float())]
        assert len(changed) >= 2


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_fused_over_an_int_base(sets, expected, tmp_path, method):
    _check(sets("int"), expected, method, tmp_path / "out", ROWS, "auto")


@pytest.mark.parametrize("method", SOME)
@pytest.mark.parametrize("kind", KINDS)
def test_fused_in_rows_and_eager_on_whole_tensors(sets, expected, tmp_path, kind, method):
    s = sets(kind)
    _check(s, expected, method, tmp_path / "fused", ONE_ROW if method == "ram_plus" else ROWS,
           "auto")  # fmt: skip
    _check(s, expected, method, tmp_path / "eager", WHOLE, "eager")


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """A tiny gpt-oss in MXFP4 and an agent of it."""
    from mxfp4_models import build_set as build_gptoss

    return build_gptoss(tmp_path_factory.mktemp("gptoss"), (0.0,))


@pytest.mark.parametrize("how", ["factors", "target_parameters"])
def test_an_adapter_of_mxfp4_experts_is_refused(gptoss, tmp_path, how):
    """gpt-oss's MXFP4 weights are its experts, 3-D: an adapter's factors for them name no
    matrix of the base, and PEFT's `target_parameters` is refused by name."""
    import json

    from safetensors.torch import save_file

    from ram_dist.api import plan
    from ram_dist.errors import CheckpointError

    s = gptoss
    name = "model.layers.0.mlp.experts.gate_up_proj"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_up_proj"]}
    if how == "target_parameters":
        config |= {"target_modules": [], "target_parameters": [name]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    key = "base_model.model." + name
    factors = {
        key + ".lora_A.weight": torch.zeros(2, 64),
        key + ".lora_B.weight": torch.zeros(128, 2),
    }
    save_file(factors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError) as refused:
        plan(base=s.base_dir, tasks=[adapter, s.agent_dirs[0]])
    assert (name if how == "factors" else "target_parameters") in str(refused.value)
