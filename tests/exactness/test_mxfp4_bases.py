"""gpt-oss's MXFP4 bases merged end to end on a real local Ray (spec: "Other quantized
bases", MXFP4, and "The base at a task's precision").

The inputs (`support/mxfp4_models.py`, which never imports ram_dist): a tiny GptOss whose
experts' weights are stored as `_blocks`/`_scales` pairs, and agents made as trainers make
them: the base loaded by transformers dequantized to bf16, about 1 % of every tensor's
elements changed at known positions (the second agent also half of the first's), one agent
saved unchanged, all saved by `save_pretrained` in bf16; and the first agent re-quantized to
MXFP4. The references (`support/reference.py` and the per-family ones) take the base's values
from the test's own decoder (`mxfp4_models.decode`), never from ram_dist.

1. Every method of the registry: the bytes of its reference, on the fused kernels with one
   expert per unit and on the eager rule with whole tensors; the RAM family's statistics;
   every element no agent changed is the base's value in bf16.
2. RAM+'s output is the bf16 gpt-oss checkpoint's names, shapes and dtypes, its config.json
   has no quantization_config and says bfloat16, and transformers loads it and runs it;
   `out_dtype` float32 writes the merged values unrounded; a `_blocks`/`_scales` pair split
   across shards merges to the same tensors, the weight written in its blocks' shard.
3. probe: an unchanged agent (bf16, float16, float32, and the bf16 copy of the base)
   changed exactly 0 elements, the others exactly the elements they changed.
4. An MXFP4-stored agent among bf16 agents: measured against x_B itself (decoded).
5. Refusals (exit 2, naming the tensor): a scale byte of 255, a pair missing a half, blocks
   of the wrong shape, an agent whose tensor is not the decoded shape.
6. The MXFP4 base and the agents read from moto's S3 server: the local merge's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, load_checkpoint, merge_config
from mxfp4_models import BLOCKS, SCALES, GptOssSet, build_set, save_unchanged, values
from precision_sets import (
    PARAMETERS,
    RAM_FAMILY,
    TASK_WEIGHTS,
    WEIGHTED,
    InputSet,
    reference_for,
    tasks_for,
)
from reference import reference_merge, reference_stats
from safetensors.torch import load_file, save_file

from ram_dist import api
from ram_dist.api import run_merge
from ram_dist.cli import main
from ram_dist.methods.registry import METHODS

# moto's server first, so that the Ray workers hold its test credentials (test 6).
pytestmark = pytest.mark.usefixtures("ray_s3")

BUCKET = "ram-dist-mxfp4"
BF16, F32 = torch.bfloat16, torch.float32
EPSILON = 1e-5
EXPERTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
#: Bytes of one expert of `down_proj` ([64, 64], bf16 in the agents): a unit holds one
#: down_proj expert, or one gate_up_proj expert ([64, 128]: atomic, so alone and over it).
ONE_EXPERT = 64 * 64 * 2
WHOLE = 10**8


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory) -> GptOssSet:
    return build_set(tmp_path_factory.mktemp("gptoss"))


def _input_set(s: GptOssSet, tasks: list[dict]) -> InputSet:
    """What `precision_sets.reference_for` reads: x_B decoded by the test's own
    decoder, in bf16, which holds every MXFP4 value exactly (docs/quantized.md: the base's
    values are bf16, so a bf16 task is measured against them as they are, and a method that
    blends values takes its own), and the tasks' values (an MXFP4 task decoded the same
    way)."""
    x_base = {name: x.to(BF16) for name, x in s.x_base.items()}
    return InputSet(
        base_dir=s.base_dir, task_dirs=[], base=s.base, x_base=x_base, tasks=tasks,
        touched={}, block=None, row_budget=0, epsilon=EPSILON,
    )  # fmt: skip


def _expected(merged: dict) -> dict:
    """As written: every tensor in bf16 (the MXFP4 weights' output dtype, the rest's own)."""
    return {name: y.to(BF16) for name, y in merged.items()}


def _merge(s: GptOssSet, tasks: list, out: Path, method: str, **kw) -> dict:
    picked = len(tasks)
    parameters = {"epsilon": EPSILON} if method in RAM_FAMILY else PARAMETERS.get(method, {})
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(picked))
    return run_merge(
        merge_config(s.base_dir, tasks, out, method=method, parameters=parameters,
                     task_parameters=per_task if method in WEIGHTED else (), **kw)
    ).data  # fmt: skip


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _assert_untouched_elements_are_the_base(got: dict, s: GptOssSet, masks: list[dict]) -> None:
    """Where no merged agent changed anything: x_B in bf16, bit for bit (exact for MXFP4
    values)."""
    for name, x in s.x_base.items():
        touched = torch.zeros(x.shape, dtype=torch.bool)
        for m in masks:
            touched |= m[name]
        free = ~touched
        assert bool(free.any())
        assert torch.equal(_bits(got[name])[free], _bits(x.to(BF16))[free]), name


def test_the_agents_are_the_base_as_transformers_loads_it(gptoss):
    """The inputs are what they claim: the test's decoder gives transformers' values, the
    unchanged agent holds them in bf16, the others differ exactly where they changed."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    s = gptoss
    for name in EXPERTS:
        blocks, scales = s.base[name + BLOCKS], s.base[name + SCALES]
        f32 = convert_moe_packed_tensors(blocks, scales, dtype=F32)
        assert torch.equal(f32.view(torch.int32), s.x_base[name].view(torch.int32))
        bf16 = convert_moe_packed_tensors(blocks, scales, dtype=BF16)
        assert torch.equal(_bits(s.agents[2][name]), _bits(bf16))
        assert torch.equal(_bits(load_checkpoint(s.bf16_dir)[name]), _bits(bf16))
    for agent, masks in zip(s.agents, s.masks, strict=True):
        assert agent.keys() == s.x_base.keys()
        for name, x in s.x_base.items():
            assert agent[name].dtype == BF16
            assert torch.equal(agent[name] != x.to(BF16), masks[name]), name


# ---- 1. every method -------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_every_method_merges_an_mxfp4_base_exactly(gptoss, tmp_path, method):
    s = gptoss
    picked = tasks_for(method)
    tasks = [s.agents[i] for i in picked]
    merged, stats = reference_for(method, _input_set(s, tasks), list(range(len(picked))))
    expected = _expected(merged)
    for budget, kernels in ((ONE_EXPERT, "auto"), (WHOLE, "eager")):
        out = tmp_path / f"{budget}-{kernels}"
        report = _merge(s, [s.agent_dirs[i] for i in picked], out, method,
                        unit_budget_bytes=budget, kernels=kernels)  # fmt: skip
        got = load_checkpoint(out)
        assert_same_bytes(got, expected)
        if budget == ONE_EXPERT:  # no unit read more than one gate_up_proj expert an input
            assert max(report["passes"]["map"]["max_unit_bytes_read_per_input"]) <= 2 * budget
        if kernels == "eager":
            assert report["passes"]["map"]["fused_elements"] == 0
        if method not in RAM_FAMILY:
            continue
        assert [t["changed"] for t in report["tasks"]] == [
            sum(int(m.sum()) for m in s.masks[i].values()) for i in picked
        ]
        assert report["tasks"][2]["changed"] == 0
        assert [t["histogram"] for t in report["tasks"]] == stats["H"]
        if "lambda_per_tensor" in stats:
            assert report["lambda_per_tensor"] == stats["lambda_per_tensor"]
        else:
            assert report["lambda_applied"] == stats["lambda32"]
        _assert_untouched_elements_are_the_base(got, s, [s.masks[i] for i in picked])


# ---- 2. the output is the bf16 gpt-oss checkpoint ------------------------------------


def test_ram_plus_output_loads_in_transformers_as_the_bf16_model(gptoss, tmp_path):
    from transformers import AutoModelForCausalLM, GptOssForCausalLM

    s = gptoss
    out = tmp_path / "out"
    run_merge(merge_config(s.base_dir, s.agent_dirs, out))
    got, bf16 = load_checkpoint(out), load_checkpoint(s.bf16_dir)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert {n: (t.dtype, t.shape) for n, t in got.items()} == {
        n: (t.dtype, t.shape) for n, t in bf16.items()
    }
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["model_type"] == "gpt_oss"

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert isinstance(model, GptOssForCausalLM) and model.dtype == BF16
    for name, p in model.state_dict().items():  # loaded as written: no dequantization
        assert torch.equal(_bits(p), _bits(got[name])), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2, 77, 3, 4, 100, 8, 6]])).logits
    assert logits.shape == (1, 10, 128) and bool(torch.isfinite(logits).all())
    # RAM+ moved the experts: not the base's values any more
    assert not torch.equal(got[EXPERTS[0]], s.x_base[EXPERTS[0]].to(BF16))


def test_out_dtype_float32_writes_the_merged_values(gptoss, tmp_path):
    """`--out-dtype float32`: the merged float32 values, unrounded, everywhere; config.json
    says float32."""
    s = gptoss
    run_merge(merge_config(s.base_dir, s.agent_dirs, tmp_path / "out", out_dtype="float32"))
    merged, _ = reference_merge(s.x_base, s.agents, "ram_plus", eps=EPSILON, out_dtype=F32)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), merged)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"


def _sharded(src: Path, out: Path, second: set[str]) -> None:
    """Checkpoint `src` (one file) as two shards and an index, `second` in the second."""
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {}
    for i, file in enumerate(names):
        part = {n: t for n, t in sorted(state.items()) if (n in second) == (i == 1)}
        save_file(part, str(out / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def test_blocks_and_scales_in_different_shards(gptoss, tmp_path):
    """A pair split across shards merges to the one-file base's tensors; the decoded weight
    is written in its blocks' shard, and transformers loads the sharded output."""
    from transformers import AutoModelForCausalLM

    s = gptoss
    base = tmp_path / "base"
    _sharded(s.base_dir, base, {EXPERTS[0] + SCALES, EXPERTS[1] + BLOCKS, "model.norm.weight"})
    merged, _ = reference_merge(s.x_base, s.agents, "ram_plus", eps=EPSILON, out_dtype=F32)
    out = tmp_path / "out"
    run_merge(merge_config(base, s.agent_dirs, out, unit_budget_bytes=ONE_EXPERT))
    assert_same_bytes(load_checkpoint(out), _expected(merged))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[EXPERTS[0]] == "model-00001-of-00002.safetensors"
    assert index[EXPERTS[1]] == "model-00002-of-00002.safetensors"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(_bits(model.state_dict()[EXPERTS[1]]), _bits(_expected(merged)[EXPERTS[1]]))


# ---- 3. probe's counts -----------------------------------------------------------------


def test_probe_counts_exactly_the_changed_elements(gptoss, tmp_path):
    """The agents in bf16, the bf16 copy of the base, the re-quantized agent, and agents
    saved unchanged from the base loaded in float16 and in float32."""
    s = gptoss
    save_unchanged(s.base_dir, tmp_path / "f16", torch.float16)
    save_unchanged(s.base_dir, tmp_path / "f32", torch.float32)
    tasks = [*s.agent_dirs, s.bf16_dir, s.requantized_dir, tmp_path / "f16", tmp_path / "f32"]
    report = api.probe(base=s.base_dir, tasks=tasks).as_dict()
    changed = [t["changed"] for t in report["tasks"]]
    known = [sum(int(m.sum()) for m in masks.values()) for masks in s.masks]
    assert known[0] > 1000 and known[1] > known[0] and known[2] == 0
    requantized = values(s.requantized)
    want = reference_stats(s.x_base, [*s.agents, load_checkpoint(s.bf16_dir), requantized])
    assert changed == [*known, 0, want["unique"][4] + want["shared"][4], 0, 0]
    # re-quantizing moved every element of a group the first agent changed
    assert changed[4] > changed[0]
    precision = report["precision"]["tasks"]
    assert [t["rounding"] for t in precision] == [0] * 7
    formats = [i["format"] for i in report["formats"]["inputs"]]  # the base's first
    assert formats[0].startswith("MXFP4") and formats[5].startswith("MXFP4")
    assert formats[1:5] == ["bfloat16"] * 4


# ---- 4. an MXFP4 agent among bf16 agents -----------------------------------------------


MIXED_METHODS = [*RAM_FAMILY, "task_arithmetic", "ties", "multislerp", "karcher"]


@pytest.mark.parametrize("method", MIXED_METHODS)
def test_an_mxfp4_agent_among_bf16_agents(gptoss, tmp_path, method):
    s = gptoss
    tasks = [values(s.requantized), s.agents[1], s.agents[2]]
    merged, stats = reference_for(method, _input_set(s, tasks), [0, 1, 2])
    report = _merge(s, [s.requantized_dir, *s.agent_dirs[1:]], tmp_path / "out", method,
                    unit_budget_bytes=ONE_EXPERT)  # fmt: skip
    assert_same_bytes(load_checkpoint(tmp_path / "out"), _expected(merged))
    if method in RAM_FAMILY:
        assert [t["histogram"] for t in report["tasks"]] == stats["H"]
        assert report["tasks"][2]["changed"] == 0


# ---- 5. refusals ---------------------------------------------------------------------


def _fails(capsys, base: Path, tasks: list[Path], out: Path, *fragments: str) -> str:
    """`ram-dist merge` exits 2 before writing a shard, its message naming `fragments`."""
    argv = ["merge", "--base", str(base), "--out", str(out)]
    for t in tasks:
        argv += ["--task", str(t)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    err = err[err.index("ram-dist: error: ") :]  # Ray may log before it
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    if out.exists():
        names = os.listdir(out)
        assert not [n for n in names if n.endswith((".safetensors", "index.json"))], names
    return err


def _edited(src: Path, out: Path, edit) -> Path:
    """A copy of checkpoint `src` with its tensors passed through `edit` (in place)."""
    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file({n: t.contiguous() for n, t in sorted(state.items())},
              str(out / "model.safetensors"), {"format": "pt"})  # fmt: skip
    return out


def test_a_scale_byte_of_255_is_refused_naming_the_tensor(gptoss, tmp_path, capsys):
    name = EXPERTS[1]

    def nan_scale(state):
        state[name + SCALES][2, 5, 1] = 255

    base = _edited(gptoss.base_dir, tmp_path / "base", nan_scale)
    out = tmp_path / "out"
    err = _fails(capsys, base, gptoss.agent_dirs, out,
                 "NaN/Inf", f"tensor {name!r}: 32 NaN/Inf", "decoded", "base model")  # fmt: skip
    assert err.count("NaN/Inf") == 1  # the base only: the bf16 agents are finite


@pytest.mark.parametrize(
    "drop, fragments",
    [
        (BLOCKS, ["has no", EXPERTS[0] + BLOCKS, "an MXFP4 weight is a pair"]),
        (SCALES, ["has no", EXPERTS[0] + SCALES, "values are unknown"]),
    ],
)
def test_half_a_pair_is_refused(gptoss, tmp_path, capsys, drop, fragments):
    base = _edited(gptoss.base_dir, tmp_path / "base", lambda st: st.pop(EXPERTS[0] + drop))
    out = tmp_path / "out"
    _fails(capsys, base, gptoss.agent_dirs, out, "base model", *fragments)


@pytest.mark.parametrize(
    "shape",
    [(4, 128, 2, 2, 8), (4, 128, 4, 8), (4, 128, 32)],
    ids=["5-d", "8-bytes", "3-d"],
)
def test_blocks_of_the_wrong_shape_are_refused(gptoss, tmp_path, capsys, shape):
    name = EXPERTS[0] + BLOCKS

    def reshape(state):
        state[name] = state[name].reshape(shape)

    base = _edited(gptoss.base_dir, tmp_path / "base", reshape)
    out = tmp_path / "out"
    _fails(capsys, base, gptoss.agent_dirs, out,
           f"tensor {name!r}", "MXFP4 blocks are U8", str(list(shape)))  # fmt: skip


def test_an_agent_of_another_shape_than_the_decoded_one_is_refused(gptoss, tmp_path, capsys):
    """An agent holding gate_up_proj unpacked but not transposed ([E, 2I, H], the blocks'
    layout) is not the decoded tensor [E, H, 2I]."""
    name = EXPERTS[0]

    def transpose(state):
        state[name] = state[name].transpose(1, 2)

    agent = _edited(gptoss.agent_dirs[1], tmp_path / "agent", transpose)
    out = tmp_path / "out"
    _fails(capsys, gptoss.base_dir, [gptoss.agent_dirs[0], agent], out,
           f"tensor {name!r}", "[4, 128, 64]", "[4, 64, 128]", "task 2")  # fmt: skip


# ---- 6. from S3 ------------------------------------------------------------------------


def test_an_mxfp4_base_in_a_bucket_merges_to_the_local_bytes(gptoss, fs, options, server,
                                                             tmp_path):  # fmt: skip
    s = gptoss
    dirs = [s.base_dir, *s.agent_dirs[:2], s.requantized_dir]
    for d in dirs:
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    base, *tasks = [f"s3://{BUCKET}/in/{d.name}" for d in dirs]
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_merge(merge_config(s.base_dir, dirs[1:], local, unit_budget_bytes=ONE_EXPERT))
    server.clear()
    run_merge(merge_config(base, tasks, remote, options, unit_budget_bytes=ONE_EXPERT))
    for name in ("model.safetensors", "config.json"):
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name
    gets = [g for g in server.object_gets(f"{BUCKET}/in/") if g.path.endswith(".safetensors")]
    assert gets and all(g.range is not None for g in gets)  # range requests only
