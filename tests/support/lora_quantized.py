"""Quantized bases with PEFT LoRA adapters as tasks (issue 42, point 1): block FP8 (ragged
16 x 24 blocks), compressed-tensors' packed INT4/INT8 and FP8 (`compressed_models`'
schemes), fbgemm_fp8 (a float32 scale per row); each with its bf16 twin, on which PEFT
builds two adapters (same names and shapes: an adapter of the base loaded in bf16), and a
bf16 agent. The adapter tasks' values are written here from the spec ("LoRA and PEFT
adapters as tasks"): `theta_t = cast(float32(theta_B^t) + delta, bf16)` with `theta_B^t =
cast(x_B, bf16)`, `x_B` by the tests' own decoders (`fp8_reference`, compressed-tensors'
`decompress`, float32 `q * scale` for fbgemm) and `delta` by `lora_reference`; a tensor the
adapter leaves alone is the base's value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from builders import build_tiny_base, load_checkpoint, save_checkpoint
from compressed_models import FP8_SCHEMES, INT_SCHEMES, write_compressed
from fp8_models import quantize_checkpoint
from fp8_reference import FP8, e4m3fn
from fp8_reference import values as fp8_values
from lora_reference import adapter_deltas
from peft_adapters import build_adapter
from safetensors.torch import save_file

BF16, F32 = torch.bfloat16, torch.float32
#: The bases: compressed-tensors' INT and FP8 sets, block FP8, fbgemm_fp8.
KINDS = ("int", "fp8-channel", "fp8-block", "fbgemm")


@dataclass
class LoraSet:
    base_dir: Path
    x_base: dict  # x_B: the base's values as the merge sees them (decoded where quantized)
    quantized: frozenset  # the names of the base's quantized weights
    task_dirs: list[Path]  # two adapters, then a bf16 agent
    tasks: list[dict]  # the tasks' values by the spec


def _fbgemm(plain: dict, src: Path, out: Path) -> tuple[dict, dict]:
    """fbgemm_fp8's form: every decoder `*_proj.weight` e4m3 with a float32 scale per row
    (`amax / 448`), its value `float32(W) * scale`."""
    stored, x = {}, {}
    for name, t in plain.items():
        if not name.endswith("proj.weight"):
            stored[name] = x[name] = t
            continue
        scale = (t.float().abs().amax(1, keepdim=True) / 448.0).to(F32)
        stored[name] = e4m3fn(t.float() / scale)
        stored[name.removesuffix("weight") + "weight_scale"] = scale
        x[name] = stored[name].to(F32) * scale
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return stored, x


def _base(kind: str, root: Path, twin: Path) -> tuple[dict, frozenset]:
    """`twin` (the bf16 tiny Llama, built unless it is there) and root/base (it quantized):
    x_B, and the quantized weights' names."""
    plain = load_checkpoint(twin) if twin.exists() else build_tiny_base(twin)
    if kind == "fp8-block":
        stored = quantize_checkpoint(twin, root / "base", (16, 24))
        x = fp8_values(stored, (16, 24))
        return x, frozenset(n for n, t in stored.items() if t.dtype == FP8)
    if kind == "fbgemm":
        _, x = _fbgemm(plain, twin, root / "base")
    else:
        schemes = INT_SCHEMES if kind == "int" else FP8_SCHEMES
        _, x = write_compressed(plain, twin, root / "base", schemes)
    return x, frozenset(n for n in x if n.endswith("proj.weight"))


def _adapter_values(x: dict, quantized: frozenset, adapter: Path) -> dict:
    """The adapter task's values (spec): the base at the task's precision (bf16 for a
    quantized weight) plus the delta, rounded to the task's dtype (bf16 for a quantized
    weight, else the base's); the adapter's own copy of an embedding in place of the base's;
    the base's value where the adapter does nothing."""
    deltas, starts, outright = adapter_deltas(x, adapter)
    out = dict(x)
    for name, delta in deltas.items():
        dtype = BF16 if name in quantized else x[name].dtype
        theta = starts[name].to(dtype) if name in starts else x[name].to(dtype)
        out[name] = (theta.to(F32) + delta).to(dtype)
    out.update({name: value.clone() for name, value in outright.items()})
    return out


def _agent(x: dict, folder: Path, copy_from: Path) -> dict:
    """A bf16 agent: the base loaded in bf16, 2 % of each tensor moved, saved."""
    g = torch.Generator().manual_seed(11)
    agent = {}
    for name, t in sorted(x.items()):
        b = t.to(BF16)
        moved = torch.rand(b.shape, generator=g) < 0.02
        step = torch.randn(b.shape, generator=g) * 0.01
        agent[name] = torch.where(moved, b.float() + step, b.float()).to(BF16)
    save_checkpoint(agent, folder, copy_from=copy_from)
    return agent


def build(kind: str, root: Path, shared: Path | None = None) -> LoraSet:
    """root/base (the `kind` of base), root/agent, and the bf16 twin and two adapters in
    `shared`'s bf16, adapter0 and adapter1 (built there unless they are: every kind's twin
    is the same tiny Llama, so one twin and its adapters serve every kind; `shared` is root
    unless given)."""
    shared = root if shared is None else shared
    x, quantized = _base(kind, root, shared / "bf16")
    adapters = [shared / "adapter0", shared / "adapter1"]
    forms = [
        dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "down_proj"), seed=1),
        dict(r=2, lora_alpha=5, target_modules=("o_proj", "gate_proj", "embed_tokens"), seed=2),
    ]
    for adapter, form in zip(adapters, forms, strict=True):
        if not adapter.exists():
            build_adapter(shared / "bf16", adapter, **form)
    tasks = [_adapter_values(x, quantized, a) for a in adapters]
    tasks.append(_agent(x, root / "agent", shared / "bf16"))
    return LoraSet(root / "base", x, quantized, [*adapters, root / "agent"], tasks)
