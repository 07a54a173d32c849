"""Tiny Llama bases stored as compressed-tensors checkpoints (INT4/INT8 `pack-quantized`,
FP8 `float-quantized`), packed by the `compressed-tensors` package itself, and agents made as
RL trainers make them. It never imports ram_dist.

- `write_compressed`: every `*_proj.weight` of the decoder layers quantized by its group's
  scheme (`SCHEMES`), with scales and zero points from compressed-tensors'
  `calculate_qparams` (min/max per group, row or tensor), compressed by its compressors, and
  config.json's `quantization_config` as llm-compressor writes it (one config group per
  scheme, targets by regex, `lm_head` ignored).
- The oracle of the base's values `x_B` is compressed-tensors' own `decompress`, in the
  scale's dtype (spec: "decoded in the scale's dtype").
- Agents: the base as `transformers` loads it with `CompressedTensorsConfig(run_compressed=
  False)` in bfloat16 (it decompresses on the CPU: the oracle's values in bf16, which the
  tests check per scheme), elements changed at known positions, saved by `save_pretrained`
  (bf16, no quantization_config).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from builders import build_tiny_base, load_checkpoint
from mxfp4_models import changed, changes, save_agent
from safetensors.torch import save_file

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Scheme:
    """One config group: which weights (a regex on the module name), how, scales' dtype."""

    pattern: str
    format: str
    weights: dict
    scale_dtype: torch.dtype = torch.bfloat16


#: INT base: the MLP in INT4 groups of 32 (Kimi-K2's and W4A16's scheme) with zero points
#: (packed along dimension 0); q/k in INT8 per channel; v/o in INT4 with one float32 scale
#: per tensor and a zero point.
INT_SCHEMES = (
    Scheme(r"re:.*mlp\..*_proj", "pack-quantized",
           dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)),
    Scheme(r"re:.*self_attn\.(q|k)_proj", "pack-quantized",
           dict(num_bits=8, type="int", symmetric=True, strategy="channel")),
    Scheme(r"re:.*self_attn\.(v|o)_proj", "pack-quantized",
           dict(num_bits=4, type="int", symmetric=False, strategy="tensor"), torch.float32),
)  # fmt: skip
#: FP8 base: the MLP per channel with bf16 scales, attention per tensor with float32 ones.
FP8_SCHEMES = (
    Scheme(r"re:.*mlp\..*_proj", "float-quantized",
           dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
    Scheme(r"re:.*self_attn\..*_proj", "float-quantized",
           dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), torch.float32),
)  # fmt: skip


#: A mixed base (`format: mixed-precision`): the MLP in INT4 groups of 32 with zero points,
#: attention FP8 per channel with bf16 scales.
MIXED_SCHEMES = (
    INT_SCHEMES[0],
    Scheme(r"re:.*self_attn\..*_proj", "float-quantized",
           dict(num_bits=8, type="float", symmetric=True, strategy="channel")),
)  # fmt: skip


def scheme_of(name: str, schemes: tuple[Scheme, ...]) -> Scheme | None:
    import re

    module = name.removesuffix(".weight")
    for s in schemes:
        if name.endswith("proj.weight") and re.fullmatch(s.pattern[3:], module):
            return s
    return None


def _args(s: Scheme):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(**s.weights)
    return args, QuantizationScheme(targets=[s.pattern], weights=args, format=s.format)


def _compressor(s: Scheme):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return (
        PackedQuantizationCompressor
        if s.format == "pack-quantized"
        else (FloatQuantizationCompressor)
    )


def quantize(weight: torch.Tensor, s: Scheme) -> tuple[State, torch.Tensor]:
    """(stored tensors by suffix, decompressed values) of one weight under scheme `s`."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, scheme = _args(s)
    rows, cols = weight.shape
    x = weight.float()
    strategy = s.weights["strategy"]
    if strategy == "group":
        x = x.reshape(rows, cols // s.weights["group_size"], -1)
    elif strategy == "channel":
        x = x.reshape(rows, 1, cols)
    else:
        x = x.reshape(1, 1, -1)
    scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
    if strategy == "tensor":
        scale, zero = scale.reshape(1), zero.reshape(1)
    state = {"weight": weight, "weight_scale": scale.to(s.scale_dtype)}
    if not s.weights.get("symmetric", True):
        state["weight_zero_point"] = zero
    stored = _compressor(s).compress(state, scheme)
    return stored, decompress(stored, s)


def decompress(stored: State, s: Scheme) -> torch.Tensor:
    """compressed-tensors' value of a stored weight (the oracle)."""
    return _compressor(s).decompress(dict(stored), _args(s)[1])["weight"]


def quantization_config(schemes: tuple[Scheme, ...]) -> dict:
    formats = {s.format for s in schemes}
    groups = {}
    for i, s in enumerate(schemes):
        groups[f"group_{i}"] = {
            "targets": [s.pattern], "format": s.format, "weights": _args(s)[0].model_dump(),
            "input_activations": None, "output_activations": None,
        }  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def write_compressed(
    state: State, src: Path, out: Path, schemes: tuple[Scheme, ...]
) -> tuple[State, State]:
    """`state` saved in `out` as a compressed-tensors checkpoint (config.json from `src`
    with the quantization_config, `src`'s other files copied). Returns (the stored tensors,
    x: each quantized weight decompressed, the rest as stored)."""
    stored: State = {}
    x: State = {}
    for name, t in sorted(state.items()):
        s = scheme_of(name, schemes)
        if s is None:
            stored[name] = x[name] = t.contiguous()
            continue
        parts, x[name] = quantize(t, s)
        stem = name.removesuffix("weight")
        stored.update({stem + k: v.contiguous() for k, v in parts.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(stored.items())), str(out / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(schemes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return stored, x


def load_as_trainer(folder: Path, dtype: torch.dtype = torch.bfloat16):
    """The compressed base as a trainer loads it: decompressed by transformers."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )


@dataclass
class CompressedSet:
    base_dir: Path
    base: State  # as stored
    x_base: State  # the oracle's values of every tensor the merge sees
    schemes: tuple[Scheme, ...]
    agent_dirs: list[Path] = field(default_factory=list)
    agents: list[State] = field(default_factory=list)
    masks: list[State] = field(default_factory=list)


def build_set(
    root: Path,
    schemes: tuple[Scheme, ...],
    densities: tuple[float, ...] = (0.01, 0.01, 0.0),
    seed: int = 0,
) -> CompressedSet:
    """root/bf16 (a tiny Llama), root/base (it, compressed by `schemes`) and root/agent{i}:
    agents of the base as transformers loads it, each changing about `densities[i]` of every
    floating tensor (the second also half of the first's; 0: saved unchanged)."""
    from transformers import AutoModelForCausalLM

    plain = build_tiny_base(root / "bf16", seed=seed)
    base, x = write_compressed(plain, root / "bf16", root / "base", schemes)
    s = CompressedSet(root / "base", base, x, schemes)
    # what transformers gives a trainer (`load_as_trainer`; the tests check it scheme by
    # scheme: with several config groups, transformers 5.24 leaves some modules unloaded)
    model = AutoModelForCausalLM.from_pretrained(str(root / "bf16"), dtype=torch.bfloat16)
    model.load_state_dict({n: t.to(torch.bfloat16) for n, t in x.items()})
    shapes = {n: p.shape for n, p in model.state_dict().items() if p.is_floating_point()}
    first = None
    for i, density in enumerate(densities):
        masks = changes(shapes, density, seed + 10 + i, first if i == 1 else None)
        first = masks if i == 0 else first
        out = root / f"agent{i}"
        save_agent(model, changed(model, masks, seed + 20 + i), out)
        s.agent_dirs.append(out)
        s.agents.append(load_checkpoint(out))
        s.masks.append(masks)
    return s
