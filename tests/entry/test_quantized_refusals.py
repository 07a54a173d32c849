"""Nothing dropped without a word: every quantized or packed format but fine-grained FP8,
gpt-oss's MXFP4, compressed-tensors' and fbgemm_fp8 (`test_compressed_bases.py`) is refused
by name before any work (exit 2), and so is an MXFP4 config
without its blocks and scales, and so is an FP8 tensor outside that layout and an
integer tensor a task changed, unless `--integers-from-base` asks for the base's copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_models import build_fp8_set
from fp8_reference import FP8, write
from refusals import command_refused, merge_argv

from ram_dist.cli import main

pytestmark = pytest.mark.usefixtures("ray_local")


def _plain(seed: int, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16), **extra}


def _trio(tmp_path: Path, states: list[dict], configs: list[dict | None]) -> tuple[Path, list]:
    """base, task 1, task 2 folders from `states`, each with its `quantization_config`."""
    dirs = []
    for name, state, quant in zip(("base", "t1", "t2"), states, configs, strict=True):
        write(state, tmp_path / name, None)
        if quant is not None:
            config = {"model_type": "llama", "quantization_config": quant}
            (tmp_path / name / "config.json").write_text(json.dumps(config))
        dirs.append(tmp_path / name)
    return dirs[0], dirs[1:]


@pytest.mark.parametrize(
    "quant, fragment",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ],
)
def test_other_quantization_is_refused_naming_it(tmp_path, capsys, quant, fragment):
    packed = {"a.qweight": torch.zeros(4, 4, dtype=torch.int32)}
    base, tasks = _trio(tmp_path, [_plain(0), _plain(1), _plain(2)], [None, quant, None])
    base_state = {**_plain(0), **packed}
    write(base_state, base, None)  # the base holds packed tensors too, without a config
    command_refused(
        capsys, merge_argv(base, tasks, tmp_path / "out"), tmp_path / "out",
        "is a packed quantized tensor", "'a.qweight'", "GPTQ/AWQ", "dequantize it first",
    )  # fmt: skip
    write(_plain(0), base, None)
    err = command_refused(
        capsys, merge_argv(base, tasks, tmp_path / "out"), tmp_path / "out", fragment
    )
    assert "task 1" in err and "t1" in err and "dequantize it first" in err


def test_an_mxfp4_config_without_blocks_is_refused(tmp_path, capsys):
    base, tasks = _trio(
        tmp_path, [_plain(0), _plain(1), _plain(2)], [None, {"quant_method": "mxfp4"}, None]
    )
    err = command_refused(
        capsys, merge_argv(base, tasks, tmp_path / "out"), tmp_path / "out",
        "declares quant_method mxfp4 but no tensor is a _blocks/_scales pair",
    )  # fmt: skip
    assert "task 1" in err and "t1" in err


@pytest.mark.parametrize(
    "tensor, fmt",
    [
        ("model.mlp.experts.gate_up_proj_blocks", "MXFP4"),
        ("model.q_proj.qzeros", "GPTQ/AWQ"),
        ("model.q_proj.weight_packed", "compressed-tensors"),
        ("model.q_proj.weight_scale", "compressed-tensors or fbgemm_fp8"),
        ("model.q_proj.SCB", "bitsandbytes int8"),
        ("model.q_proj.weight.absmax", "bitsandbytes 4-bit"),
    ],
)
def test_packed_tensors_are_refused_by_name(tmp_path, capsys, tensor, fmt):
    packed = {tensor: torch.zeros(4, 2, dtype=torch.uint8)}
    states = [_plain(0, **packed), _plain(1, **packed), _plain(2, **packed)]
    base, tasks = _trio(tmp_path, states, [None, None, None])
    command_refused(
        capsys, merge_argv(base, tasks, tmp_path / "out"), tmp_path / "out",
        f"tensor {tensor!r}", "base model", "model.safetensors", fmt,
    )  # fmt: skip


def _fp8_quant(block=(16, 8)) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}


def test_f8_tensors_outside_the_fine_grained_layout(tmp_path, capsys):
    w = torch.zeros(16, 8).to(FP8)
    s = torch.ones(1, 1)
    cases = [
        # (state, config, fragments)
        ({"w": torch.zeros(16, 8).to(torch.float8_e5m2), "w_scale_inv": s}, _fp8_quant(),
         ["tensor 'w'", "F8_E5M2", "dequantize it first"]),
        ({"w": w}, _fp8_quant(), ["tensor 'w'", "no companion 'w_scale_inv'"]),
        ({"w": w, "w_scale_inv": torch.ones(2, 1)}, _fp8_quant(),
         ["tensor 'w_scale_inv'", "must be F32 or BF16 of shape [1, 1]"]),
        ({"w": w, "w_scale_inv": s}, None,
         ["tensor 'w'", "declares no quantization_config"]),
        ({"w": w, "w_scale_inv": s}, {"quant_method": "fp8", "weight_block_size": 128},
         ["weight_block_size 128", "per-channel FP8 is merged in compressed-tensors'"]),
        ({"w": w, "w_scale_inv": s}, {**_fp8_quant(), "activation_scheme": "static"},
         ["activation_scheme 'static'"]),
    ]  # fmt: skip
    for k, (state, quant, fragments) in enumerate(cases):
        root = tmp_path / str(k)
        plain = {"w": torch.zeros(16, 8, dtype=torch.bfloat16)}
        base, tasks = _trio(root, [plain, state, plain], [None, quant, None])
        if quant is None:  # write() gave it no config at all
            (tasks[0] / "config.json").write_text("{}")
        err = command_refused(
            capsys, merge_argv(base, tasks, root / "out"), root / "out", *fragments
        )
        assert "task 1" in err, err


def test_changed_integer_tensor_is_refused_unless_asked(tmp_path, capsys):
    ids = torch.arange(6, dtype=torch.int64)
    states = [
        _plain(0, ids=ids),
        _plain(1, ids=ids),
        _plain(2, ids=ids + 1),  # task 2 changed an integer tensor
    ]
    base, tasks = _trio(tmp_path, states, [None, None, None])
    out = tmp_path / "out"
    command_refused(
        capsys, merge_argv(base, tasks, out), out,
        "tensor 'ids' (I64) in task 2", "model.safetensors", "differs from the base model",
        "--integers-from-base",
    )  # fmt: skip
    assert main(merge_argv(base, tasks, out, "--integers-from-base")) == 0
    printed = capsys.readouterr().out
    assert "copied from the base though a task changed them (--integers-from-base): ids" in printed
    report = json.loads((out / "merge_report.json").read_text())
    assert report["integers_from_base"] == {"allowed": True, "copied_though_changed": ["ids"]}
    card = (out / "README.md").read_text()
    assert "**Not merged:** 1 integer or bool tensor(s)" in card and "`ids`" in card


def test_unchanged_integer_tensor_is_copied_without_a_word(tmp_path, capsys):
    ids = torch.arange(6, dtype=torch.int64)
    base, tasks = _trio(tmp_path, [_plain(k, ids=ids) for k in range(3)], [None, None, None])
    assert main(merge_argv(base, tasks, tmp_path / "out")) == 0
    report = json.loads((tmp_path / "out" / "merge_report.json").read_text())
    assert report["integers_from_base"]["copied_though_changed"] == []


def test_plan_refuses_as_merge_does(tmp_path, capsys):
    s = build_fp8_set(tmp_path / "set", task_formats=("fp8", "fp8"), densities=(0.1, 0.2))
    (s.task_dirs[0] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    argv = ["plan", "--base", str(s.base_dir)]
    for t in s.task_dirs:
        argv += ["--task", str(t)]
    assert main(argv) == 2
    assert "declares no quantization_config" in capsys.readouterr().err
