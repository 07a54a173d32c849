"""compressed-tensors bases (INT4/INT8 `pack-quantized`, FP8 `float-quantized`) merged end to
end on a real local Ray (spec: "Other quantized bases", and "The base at a task's
precision").

The inputs (`support/compressed_models.py`, which never imports ram_dist): a tiny Llama whose
decoder weights compressed-tensors itself packed, with several schemes in one checkpoint (the
INT set: INT4 groups of 32 with packed zero points, INT8 per channel, INT4 per tensor with a
float32 scale and a zero point; the FP8 set: per channel with bf16 scales, per tensor with
float32 ones), and agents as trainers make them (the base as transformers loads it, about 1 %
of each tensor changed at known positions, one agent unchanged, saved in bf16). The oracle of
the base's values is compressed-tensors' own `decompress`.

1. transformers loads each scheme as compressed-tensors decompresses it (the agents' start).
2. Every method of the registry on the INT base and on the FP8 base, against the
   references: fused at a few rows per unit on one base and eager on whole tensors on the
   other, alternating along the registry (every method meets both bases and both paths;
   each base meets both paths over half the registry). The FP8 base is written FP8 again by
   the block rule's analogue (a scale per row or per tensor) or in bf16 with `out_dtype`.
3. probe: exact changed counts, the formats and the "measured against" sentences in words.
4. The output of an INT base is the bf16 Llama: config.json without quantization_config,
   loaded and run by transformers; of a mixed INT4 + FP8 base, config.json keeps only the
   FP8 group, and transformers loads it as compressed-tensors decompresses it.
5. Refusals, exit 2 before any work: an undefined format or scheme, a packed shape that
   disagrees with the scales or the config, a weight_shape that disagrees (read before
   any work, locally and from the S3 server).
6. An INT base read from moto's S3 server: the local merge's bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, build_tiny_base, load_checkpoint, merge_config
from compressed_models import (
    FP8_SCHEMES,
    INT_SCHEMES,
    MIXED_SCHEMES,
    CompressedSet,
    build_set,
    decompress,
    load_as_trainer,
    scheme_of,
    write_compressed,
)
from fp8_reference import block_view, e4m3fn, expand
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

from ram_dist import api
from ram_dist.api import run_merge
from ram_dist.cli import main
from ram_dist.errors import CheckpointError
from ram_dist.methods.registry import METHODS

pytestmark = pytest.mark.usefixtures("ray_s3")

BUCKET = "ram-dist-compressed"
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
EPSILON = 1e-5
#: A unit of about one row of the widest weight (128 bf16 values an input).
ONE_ROW = 128 * 2
#: Five such rows: every quantized weight still spans several units, and units start inside
#: a packed zero point's 8 rows, for a fifth of the one-row units' tasks (the every-method
#: tests merge 24 times at this budget).
FEW_ROWS = 5 * ONE_ROW
WHOLE = 10**8


def _path(method: str, base: str) -> tuple[int, str]:
    """The unit budget and kernels a method merges `base` ("int" or "fp8") with: fused at a
    few rows per unit on one base, eager on whole tensors on the other, alternating along the
    registry."""
    fused = (list(METHODS).index(method) % 2 == 0) == (base == "int")
    return (FEW_ROWS, "auto") if fused else (WHOLE, "eager")


@pytest.fixture(scope="module")
def int_set(tmp_path_factory) -> CompressedSet:
    return build_set(tmp_path_factory.mktemp("int"), INT_SCHEMES)


@pytest.fixture(scope="module")
def fp8_set(tmp_path_factory) -> CompressedSet:
    return build_set(tmp_path_factory.mktemp("fp8"), FP8_SCHEMES)


def _input_set(s: CompressedSet, tasks: list[dict]) -> InputSet:
    """The base's values as compressed-tensors decodes them (in the scale's dtype)."""
    return InputSet(
        base_dir=s.base_dir, task_dirs=[], base=s.base, x_base=dict(s.x_base), tasks=tasks,
        touched={}, block=None, row_budget=0, epsilon=EPSILON,
    )  # fmt: skip


def _merge(s: CompressedSet, picked: list[int], out: Path, method: str, **kw) -> dict:
    parameters = {"epsilon": EPSILON} if method in RAM_FAMILY else PARAMETERS.get(method, {})
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(len(picked)))
    return run_merge(
        merge_config(s.base_dir, [s.agent_dirs[i] for i in picked], out, method=method,
                     parameters=parameters,
                     task_parameters=per_task if method in WEIGHTED else (), **kw)
    ).data  # fmt: skip


def _merge_on_its_path(s: CompressedSet, base: str, out: Path, method: str) -> tuple:
    """The reference's merged values and statistics for the method's tasks (`tasks_for`), and
    the report of ram-dist's merge of them into `out` on the method's `_path` for `base`."""
    picked = tasks_for(method)
    merged, stats = reference_for(method, _input_set(s, [s.agents[i] for i in picked]),
                                  list(range(len(picked))))  # fmt: skip
    budget, kernels = _path(method, base)
    report = _merge(s, picked, out, method, unit_budget_bytes=budget, kernels=kernels)
    return merged, stats, report


def _int_expected(s: CompressedSet, merged: dict) -> dict:
    """As written: every tensor in bf16 (a packed weight's output dtype, the rest's own)."""
    return {name: y.to(BF16) for name, y in merged.items()}


def _fp8_expected(s: CompressedSet, merged: dict) -> dict:
    """An FP8 weight written FP8 again: where y is the base's value bit for bit over the
    scale's group (a row, or the tensor), the base's bytes and scale; elsewhere amax / 448
    stored in the scale's dtype, then e4m3fn of y over it."""
    out = {}
    for name, y in merged.items():
        q = s.base.get(name)
        if q is None or q.dtype != FP8:
            out[name] = y.to(s.base[name].dtype)
            continue
        base_s = s.base[name + "_scale"]
        rows, cols = y.shape
        block = (1, cols) if base_s.numel() == rows and rows > 1 else (rows, cols)
        x = s.x_base[name].to(F32)
        same = block_view((y.view(torch.int32) == x.view(torch.int32)).to(torch.int8), block)
        unchanged = same.amin(dim=(2, 3)).bool().reshape(base_s.shape)
        amax = block_view(y.abs(), block).amax(dim=(2, 3)).reshape(base_s.shape)
        fresh = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0).to(base_s.dtype)
        scale = torch.where(unchanged, base_s, fresh)
        grid = scale.to(F32).reshape(-1, 1) if block[0] == 1 else scale.to(F32).reshape(1, 1)
        codes = e4m3fn(y / expand(grid, (rows, cols), block)).view(torch.uint8)
        keep = expand(unchanged.reshape(grid.shape), (rows, cols), block)
        out[name] = torch.where(keep, q.view(torch.uint8), codes).view(FP8)
        out[name + "_scale"] = scale
    return out


# ---- 1. the agents' start --------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny bf16 Llama: its folder and tensors."""
    folder = tmp_path_factory.mktemp("plain") / "bf16"
    return folder, build_tiny_base(folder)


@pytest.mark.parametrize("scheme", [*INT_SCHEMES, *FP8_SCHEMES], ids=lambda s: s.pattern[3:])
def test_transformers_loads_each_scheme_as_compressed_tensors_decodes_it(
    plain_llama, tmp_path, scheme
):
    src, plain = plain_llama
    _, x = write_compressed(plain, src, tmp_path / "base", (scheme,))
    loaded = load_as_trainer(tmp_path / "base").state_dict()
    quantized = [n for n in x if not torch.equal(x[n], plain[n])]
    assert len(quantized) >= 4
    for name, value in x.items():
        assert torch.equal(loaded[name].view(torch.int16), value.to(BF16).view(torch.int16)), name


# ---- 2. every method -------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_every_method_merges_an_int_base_exactly(int_set, tmp_path, method):
    s = int_set
    merged, stats, report = _merge_on_its_path(s, "int", tmp_path / "out", method)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), _int_expected(s, merged))
    if method in RAM_FAMILY:
        assert [t["histogram"] for t in report["tasks"]] == stats["H"]
        assert report["tasks"][2]["changed"] == 0


@pytest.mark.parametrize("method", METHODS)
def test_every_method_merges_an_fp8_base_exactly(fp8_set, tmp_path, method):
    s = fp8_set
    merged, stats, report = _merge_on_its_path(s, "fp8", tmp_path / "out", method)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), _fp8_expected(s, merged))
    if method in RAM_FAMILY:
        assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    if method in ("ram_plus", "ties", "model_stock"):
        _merge(s, tasks_for(method), tmp_path / "bf16", method, out_dtype="bfloat16")
        assert_same_bytes(load_checkpoint(tmp_path / "bf16"),
                          {n: y.to(BF16) for n, y in merged.items()})  # fmt: skip


@pytest.fixture(scope="module")
def int4_agent(int_set, tmp_path_factory) -> tuple[Path, dict]:
    """The INT set's first agent packed by compressed-tensors again: its folder and decoded
    values."""
    folder = tmp_path_factory.mktemp("agent0") / "agent0-int"
    _, x = write_compressed(int_set.agents[0], int_set.agent_dirs[0], folder, INT_SCHEMES)
    return folder, x


@pytest.mark.parametrize("method", ["ram_plus", "ties", "multislerp"])
def test_an_int4_agent_among_bf16_agents(int_set, int4_agent, tmp_path, method):
    """Any input may be quantized: the first agent packed by compressed-tensors again is
    measured by its decoded values."""
    s = int_set
    folder, x = int4_agent
    tasks = [x, s.agents[1], s.agents[2]]
    merged, stats = reference_for(method, _input_set(s, tasks), [0, 1, 2])
    parameters = {"epsilon": EPSILON} if method in RAM_FAMILY else PARAMETERS.get(method, {})
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(3))
    dirs = [folder, *s.agent_dirs[1:]]
    report = run_merge(
        merge_config(s.base_dir, dirs, tmp_path / "out", method=method, parameters=parameters,
                     task_parameters=per_task if method in WEIGHTED else (),
                     unit_budget_bytes=ONE_ROW)
    ).data  # fmt: skip
    assert_same_bytes(load_checkpoint(tmp_path / "out"), _int_expected(s, merged))
    if method in RAM_FAMILY:
        assert [t["histogram"] for t in report["tasks"]] == stats["H"]
        assert report["formats"]["inputs"][1]["format"].startswith("compressed-tensors")


def _fbgemm_set(root: Path) -> CompressedSet:
    """A tiny Llama in fbgemm_fp8's form: every decoder `*_proj.weight` e4m3 with a float32
    scale per row (`amax / 448`), its value `float32(W) * scale` (no rounding after); agents
    in bf16 measured against it rounded to bf16, built as `compressed_models.build_set`
    builds them."""
    from compressed_models import changed, changes, save_agent
    from transformers import AutoModelForCausalLM

    plain = build_tiny_base(root / "bf16")
    stored, x = {}, {}
    for name, t in plain.items():
        if not name.endswith("proj.weight"):
            stored[name] = x[name] = t
            continue
        w = t.float()
        scale = (w.abs().amax(1, keepdim=True) / 448.0).to(F32)
        stored[name] = e4m3fn(w / scale)
        stored[name.removesuffix("weight") + "weight_scale"] = scale
        x[name] = stored[name].to(F32) * scale
    (root / "base").mkdir()
    save_file(stored, str(root / "base" / "model.safetensors"), {"format": "pt"})
    config = json.loads((root / "bf16" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    }  # fmt: skip
    (root / "base" / "config.json").write_text(json.dumps(config))
    s = CompressedSet(root / "base", stored, x, ())
    model = AutoModelForCausalLM.from_pretrained(str(root / "bf16"), dtype=BF16)
    model.load_state_dict({n: t.to(BF16) for n, t in x.items()})
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    first = None
    for i, density in enumerate((0.01, 0.01, 0.0)):
        masks = changes(shapes, density, 10 + i, first if i == 1 else None)
        first = masks if i == 0 else first
        save_agent(model, changed(model, masks, 20 + i), root / f"agent{i}")
        s.agent_dirs.append(root / f"agent{i}")
        s.agents.append(load_checkpoint(root / f"agent{i}"))
        s.masks.append(masks)
    return s


@pytest.fixture(scope="module")
def fbgemm_set(tmp_path_factory) -> CompressedSet:
    return _fbgemm_set(tmp_path_factory.mktemp("fbgemm"))


@pytest.mark.parametrize("method", ["ram_plus", "ties", "slerp"])
def test_an_fbgemm_fp8_base_merges_exactly(fbgemm_set, tmp_path, method):
    s = fbgemm_set
    picked = tasks_for(method)
    merged, _ = reference_for(method, _input_set(s, [s.agents[i] for i in picked]),
                           list(range(len(picked))))  # fmt: skip
    report = _merge(s, picked, tmp_path / "out", method, unit_budget_bytes=FEW_ROWS)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), _fp8_expected(s, merged))
    if method == "ram_plus":
        known = [sum(int(m.sum()) for m in masks.values()) for masks in s.masks]
        assert [t["changed"] for t in report["tasks"]] == known
        assert report["formats"]["inputs"][0]["format"].startswith("fbgemm_fp8 (FP8 per")


# ---- 3. probe ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["int", "fp8"])
def test_probe_counts_exactly_the_changed_elements(int_set, fp8_set, which):
    s = int_set if which == "int" else fp8_set
    report = api.probe(base=s.base_dir, tasks=s.agent_dirs).as_dict()
    known = [sum(int(m.sum()) for m in masks.values()) for masks in s.masks]
    assert known[0] > 500 and known[2] == 0
    assert [t["changed"] for t in report["tasks"]] == known
    assert [t["rounding"] for t in report["precision"]["tasks"]] == [0, 0, 0]
    words = report["formats"]
    if which == "int":
        assert words["inputs"][0]["format"] == (
            "compressed-tensors (INT4/INT8 pack-quantized, 14 weights; the rest bfloat16)"
        )
        assert words["output"] == "bfloat16"
        # v/o have float32 scales: their values are float32, so bf16 agents are measured
        # against them rounded to bf16
        assert words["measured_against"][0] == (
            "task 1: bfloat16, measured against the INT4 base rounded to bfloat16 (4 tensors)"
        )
    else:
        assert words["inputs"][0]["format"].startswith("compressed-tensors (FP8 per channel")
        assert words["output"].startswith("FP8 (e4m3, a scale per row or tensor")
        assert words["measured_against"][0] == (
            "task 1: bfloat16, measured against the FP8 base rounded to bfloat16 (8 tensors)"
        )


# ---- 4. the output of an INT base ---------------------------------------------------------


def test_an_int_base_merges_to_the_bf16_llama(int_set, tmp_path):
    from transformers import AutoModelForCausalLM

    s = int_set
    out = tmp_path / "out"
    run_merge(merge_config(s.base_dir, s.agent_dirs, out))
    got = load_checkpoint(out)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in got.items()} == {
        n: (BF16, tuple(t.shape)) for n, t in s.x_base.items()
    }
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    for name, p in model.state_dict().items():
        assert torch.equal(p.view(torch.int16), got[name].view(torch.int16)), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2, 77, 3]])).logits
    assert bool(torch.isfinite(logits).all())


def test_a_mixed_base_keeps_only_its_fp8_groups_in_config_json(tmp_path):
    """INT4 MLP and FP8 attention in one base (`format: mixed-precision`): the INT weights
    are written in bf16, the FP8 ones FP8 again, and config.json's quantization_config
    describes only those (the FP8 group, its format); transformers loads the output as
    compressed-tensors decompresses it and runs it."""
    s = build_set(tmp_path / "in", MIXED_SCHEMES)
    base_quant = json.loads((s.base_dir / "config.json").read_text())["quantization_config"]
    assert base_quant["format"] == "mixed-precision" and len(base_quant["config_groups"]) == 2
    merged, _ = reference_for("ram_plus", _input_set(s, s.agents), [0, 1, 2])
    fp8 = {n for n, t in s.base.items() if t.dtype == FP8}
    expected = _fp8_expected(s, {n: y for n, y in merged.items() if n in fp8})
    expected |= {n: y.to(BF16) for n, y in merged.items() if n not in fp8}
    out = tmp_path / "out"
    _merge(s, [0, 1, 2], out, "ram_plus", unit_budget_bytes=ONE_ROW)
    got = load_checkpoint(out)
    assert_same_bytes(got, expected)
    assert len(fp8) == 8 and sum(1 for n in got if n.endswith("mlp.down_proj.weight")) == 2
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["config_groups"] == {"group_1": base_quant["config_groups"]["group_1"]}
    assert quant["format"] == "float-quantized" and quant["ignore"] == ["lm_head"]
    rest = {k: v for k, v in quant.items() if k not in ("config_groups", "format")}
    assert rest == {k: v for k, v in base_quant.items() if k not in ("config_groups", "format")}
    model = load_as_trainer(out)
    for name, p in model.state_dict().items():
        scheme = scheme_of(name, MIXED_SCHEMES)
        if name in fp8:
            parts = {"weight": got[name], "weight_scale": got[name + "_scale"]}
            want = decompress(parts, scheme).to(BF16)
        else:
            want = got[name]
        assert torch.equal(p.view(torch.int16), want.view(torch.int16)), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2, 77, 3]])).logits
    assert bool(torch.isfinite(logits).all())


# ---- 5. refusals ---------------------------------------------------------------------------


def _fails(
    capsys, base: Path, tasks: list[Path], out: Path, *fragments: str, flags: tuple = ()
) -> str:
    """The merge's stderr; its error line exit 2, with `fragments`, without a traceback; no
    shard or index written."""
    argv = ["merge", "--base", str(base), "--out", str(out), *flags]
    for t in tasks:
        argv += ["--task", str(t)]
    code = main(argv)
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    err = stderr[stderr.index("ram-dist: error: ") :]
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    if out.exists():
        names = os.listdir(out)
        assert not [n for n in names if n.endswith((".safetensors", "index.json"))], names
    return stderr


def _copy(src: Path, out: Path, edit_state=None, edit_config=None) -> Path:
    shutil.copytree(src, out)
    if edit_state is not None:
        state = load_file(str(out / "model.safetensors"))
        edit_state(state)
        save_file({n: t.contiguous() for n, t in sorted(state.items())},
                  str(out / "model.safetensors"), {"format": "pt"})  # fmt: skip
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    return out


DOWN = "model.layers.0.mlp.down_proj."


def _set_group(key, value):
    def edit(q):
        q["config_groups"]["group_0"]["weights"][key] = value

    return edit


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (lambda q: q.update(format="nvfp4-pack-quantized") or [
            g.pop("format") for g in q["config_groups"].values()],
         ["format 'nvfp4-pack-quantized'", "pack-quantized (INT4/INT8)"]),
        (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
         ["sparsity_config (sparse-24-bitmask)"]),
        (_set_group("num_bits", 2), ["2-bit", "int 4/8-bit"]),
        (_set_group("actorder", "group"), ["actorder 'group'"]),
        (_set_group("group_size", 64), ["model.layers.0.mlp.down_proj.weight_packed",
                                        "which no group of config.json"]),
    ],
    ids=["nvfp4", "sparse-24", "2-bit", "actorder", "group-size"],
)  # fmt: skip
def test_a_scheme_the_spec_does_not_define_is_refused(int_set, tmp_path, capsys, edit, fragments):
    base = _copy(int_set.base_dir, tmp_path / "base", edit_config=edit)
    _fails(capsys, base, int_set.agent_dirs, tmp_path / "out", "base model", *fragments)


def test_a_packed_shape_that_disagrees_with_the_scales_is_refused(int_set, tmp_path, capsys):
    def cut(state):
        state[DOWN + "weight_packed"] = state[DOWN + "weight_packed"][:, :12]

    base = _copy(int_set.base_dir, tmp_path / "base", cut)
    name = DOWN + "weight_packed"
    _fails(capsys, base, int_set.agent_dirs, tmp_path / "out",
           f"tensor {name!r}", "[64, 12] words", "with scales [64, 4]")  # fmt: skip


def _lie(state):
    state[DOWN + "weight_shape"] = torch.tensor([64, 120])


def test_a_weight_shape_that_disagrees_is_refused_before_any_work(int_set, tmp_path, capsys):
    """Its two integers are values: read once on the driver before the lease and the first
    pass (no job_start event, no output folder), not with the rows."""
    base = _copy(int_set.base_dir, tmp_path / "base", _lie)
    out = tmp_path / "out"
    stderr = _fails(capsys, base, int_set.agent_dirs, out,
                    f"tensor {DOWN + 'weight_shape'!r} in base model ({base}), file ",
                    "model.safetensors says [64, 120]", "hold [64, 128] (4-bit codes)",
                    flags=("--log-format", "json"))  # fmt: skip
    assert '"job_start"' not in stderr and not out.exists()
    with pytest.raises(CheckpointError, match="says \\[64, 120\\]"):
        api.probe(base=base, tasks=int_set.agent_dirs)


def test_an_agent_of_another_shape_is_refused(int_set, tmp_path, capsys):
    name = DOWN + "weight"

    def transpose(state):
        state[name] = state[name].t()

    agent = _copy(int_set.agent_dirs[1], tmp_path / "agent", transpose)
    _fails(capsys, int_set.base_dir, [int_set.agent_dirs[0], agent], tmp_path / "out",
           f"tensor {name!r}", "[128, 64]", "[64, 128]", "task 2")  # fmt: skip


# ---- 6. from S3 ------------------------------------------------------------------------------


def test_an_int_base_in_a_bucket_merges_to_the_local_bytes(int_set, fs, options, server,
                                                           tmp_path):  # fmt: skip
    s = int_set
    dirs = [s.base_dir, *s.agent_dirs[:2]]
    for d in dirs:
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    base, *tasks = [f"s3://{BUCKET}/in/{d.name}" for d in dirs]
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_merge(merge_config(s.base_dir, dirs[1:], local, unit_budget_bytes=FEW_ROWS))
    server.clear()
    run_merge(merge_config(base, tasks, remote, options, unit_budget_bytes=FEW_ROWS))
    for name in ("model.safetensors", "config.json"):
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name
    gets = [g for g in server.object_gets(f"{BUCKET}/in/") if g.path.endswith(".safetensors")]
    assert gets and all(g.range is not None for g in gets)


def test_a_weight_shape_in_a_bucket_that_disagrees_is_refused_before_any_work(
    int_set, fs, options, server, tmp_path
):
    """From the S3 server: the base's file is read for its header (one read from byte 0) and
    for its weight_shape tensors' bytes (ranged reads, one request for neighbours), nothing
    else; the error names the tensor and its file."""
    s = int_set
    base = _copy(s.base_dir, tmp_path / "lying", _lie)
    fs.put(str(base), f"{BUCKET}/lying/base", recursive=True)
    for d in s.agent_dirs[:2]:
        fs.put(str(d), f"{BUCKET}/lying/{d.name}", recursive=True)
    server.clear()
    tasks = [f"s3://{BUCKET}/lying/{d.name}" for d in s.agent_dirs[:2]]
    config = merge_config(f"s3://{BUCKET}/lying/base", tasks, tmp_path / "out", options)
    with pytest.raises(CheckpointError) as e:
        run_merge(config)
    named = f"tensor {DOWN + 'weight_shape'!r} in base model (s3://{BUCKET}/lying/base)"
    assert named in str(e.value) and "says [64, 120]" in str(e.value)
    assert not (tmp_path / "out").exists()
    gets = [g for g in server.object_gets(f"{BUCKET}/lying/base/") if g.path.endswith("tensors")]
    header = [g for g in gets if g.range is not None and g.range.startswith("bytes=0-")]
    shapes = [g for g in gets if g not in header]
    stated = [t for n, t in s.base.items() if n.endswith(".weight_shape")]
    assert len(header) == 1 and len(stated) == 14 and 1 <= len(shapes) <= len(stated)
    assert sum(g.nbytes for g in shapes) == sum(t.numel() * t.element_size() for t in stated)
