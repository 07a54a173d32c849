"""`plan` counts a packed input at the bytes a pass reads of it: MXFP4's half byte of code and
scale byte per 32 values, compressed-tensors' int32 words, scales and packed zero points, not
one byte per element. The reference is the files themselves: each input's safetensors file
less its header, less the `weight_shape` tensors (read once before any work, not by a pass).

The checkpoints are small and written here (headers and bytes; `plan` reads headers only):
gpt-oss's MXFP4 expert pair and a compressed-tensors INT4 (groups of 32, bf16 scales, packed
zero points) and INT8 (per channel) base, each with bf16 agents under the decoded names and
shapes, as trainers save them; one INT agent packed as the base is.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ram_dist import api

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

BF16 = torch.bfloat16
#: gpt-oss's expert weight: 2 experts, 24 rows, 2 groups of 32 values.
E, R, G = 2, 24, 2
#: compressed-tensors' weights: INT4 [40, 96] (3 groups of 32), INT8 [16, 96] per channel.
INT4, INT8 = (40, 96), (16, 96)


def _config(folder: Path, quantization: dict | None) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))


def _save(folder: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    _config(folder, quantization)
    return folder


def _read_bytes(folder: Path, left_out: str = "\0") -> int:
    """Bytes of the file's tensors (its size less the 8-byte length and the header), less
    those of tensors whose name ends with `left_out`."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    skipped = sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__" and k.endswith(left_out)
    )
    return path.stat().st_size - 8 - n - skipped


def _mxfp4_set(root: Path) -> list[Path]:
    g = torch.Generator().manual_seed(0)
    norm = torch.randn(G * 32, generator=g).to(BF16)
    base = {
        "model.layers.0.mlp.experts.down_proj_blocks": torch.randint(
            0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g
        ),
        "model.layers.0.mlp.experts.down_proj_scales": torch.randint(
            120, 130, (E, R, G), dtype=torch.uint8, generator=g
        ),
        "model.norm.weight": norm,
    }
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.norm"]}
    dirs = [_save(root / "base", base, quant)]
    for i in range(2):
        agent = {
            "model.layers.0.mlp.experts.down_proj": torch.randn(E, G * 32, R, generator=g).to(BF16),
            "model.norm.weight": norm,
        }
        dirs.append(_save(root / f"agent{i}", agent, None))
    return dirs


def _packed(bits: int, rows: int, cols: int, groups: int, zero: bool, g) -> dict:
    """One compressed-tensors weight's stored tensors (random codes: `plan` reads none)."""
    out = {
        "weight_packed": torch.randint(
            -(2**31), 2**31 - 1, (rows, cols * bits // 32), dtype=torch.int32, generator=g
        ),
        "weight_scale": torch.rand(rows, groups, generator=g).to(BF16),
        "weight_shape": torch.tensor([rows, cols]),
    }
    if zero:
        out["weight_zero_point"] = torch.zeros(-(-rows * bits // 32), groups, dtype=torch.int32)
    return out


INT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["re:.*down_proj"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                        "strategy": "group", "group_size": 32},
        },
        "group_1": {
            "targets": ["re:.*up_proj"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        },
    },
}  # fmt: skip


def _int_set(root: Path) -> list[Path]:
    g = torch.Generator().manual_seed(1)
    norm = torch.randn(INT4[1], generator=g).to(BF16)
    stored = {"model.norm.weight": norm}
    for module, (bits, (rows, cols), groups, zero) in {
        "model.layers.0.mlp.down_proj": (4, INT4, INT4[1] // 32, True),
        "model.layers.0.mlp.up_proj": (8, INT8, 1, False),
    }.items():
        for suffix, t in _packed(bits, rows, cols, groups, zero, g).items():
            stored[f"{module}.{suffix}"] = t
    dirs = [_save(root / "base", stored, INT_CONFIG)]
    agent = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(*INT4, generator=g).to(BF16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(*INT8, generator=g).to(BF16),
        "model.norm.weight": norm,
    }
    dirs.append(_save(root / "agent0", agent, None))
    dirs.append(_save(root / "agent1", dict(stored), INT_CONFIG))  # packed, as the base is
    return dirs


@pytest.mark.parametrize("which", ["mxfp4", "int"])
@pytest.mark.parametrize("budget", [None, 4096, 10**8])
def test_the_plan_reads_what_the_files_hold(tmp_path, which, budget):
    """A pass reads every tensor of every input once; `plan`'s bytes per pass are the
    files' bytes, at the default budget, at a few rows of the widest input a unit, and at
    whole tensors."""
    base, *tasks = (_mxfp4_set if which == "mxfp4" else _int_set)(tmp_path)
    planned = api.plan(base=base, tasks=tasks, unit_budget_bytes=budget).as_dict()
    expected = sum(_read_bytes(d, left_out=".weight_shape") for d in (base, *tasks))
    if which == "mxfp4":  # 17 bytes per 32 values: a half byte of code, a scale byte
        assert _read_bytes(base) == E * R * G * 17 + G * 32 * 2
    else:  # int32 words, bf16 scales, zero points 8 rows to a word; the shapes left out
        rows, cols = INT4
        int4 = rows * cols // 2 + rows * cols // 32 * 2 + -(-rows // 8) * (cols // 32) * 4
        int8 = INT8[0] * INT8[1] + INT8[0] * 2
        assert _read_bytes(base, left_out=".weight_shape") == int4 + int8 + cols * 2
    bytes_per_pass = planned["bytes_per_pass"]
    assert bytes_per_pass["map"] == expected
    assert bytes_per_pass["reduce_round"] == expected
    assert planned["work_units"] > (1 if budget == 4096 else 0)
