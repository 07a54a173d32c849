"""A tiny Llama-4 base stored as `fbgemm_fp8` checkpoints are (Llama-4's FP8 release), and
agents made as RL trainers make them. It never imports ram_dist.

The layout is transformers' (`FbgemmFp8Llama4TextExperts`, `FbgemmFp8Linear`, 5.x):

- each decoder `*_proj.weight` [R, C]: e4m3fn with `*_proj.weight_scale` F32 [R, 1];
- each MoE layer's experts, `feed_forward.experts.gate_up_proj` [E, H, 2I] and
  `feed_forward.experts.down_proj` [E, I, H]: e4m3fn with `gate_up_proj_scale` F32 [E, 1, 2I]
  and `down_proj_scale` F32 [E, H, 1]: one scale per expert and column of the stored tensor
  (the row of the [C, R] matrix the GEMM reads), as `FbgemmFp8Quantize` computes them
  (`amax / 448` per group);
- everything else (embeddings, norms, the router) bf16.

The base's values, written here from the spec (`fbgemm_fp8`: one float32 multiplication,
`float32(W) * scale`, nothing rounded after), are float32; the agents are the bf16 model
holding them rounded to bf16, with about 1 % of every tensor's elements changed at known
positions (the second also half of the first's), one saved unchanged, all by
`save_pretrained` in bf16.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from builders import load_checkpoint
from mxfp4_models import changed, changes, save_agent
from safetensors.torch import save_file

State = dict[str, torch.Tensor]
BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
EXPERTS = 4
#: The experts' weights of layer 0 (both layers are MoE layers).
GATE_UP = "model.layers.0.feed_forward.experts.gate_up_proj"
DOWN = "model.layers.0.feed_forward.experts.down_proj"
QUANTIZATION = {
    "quant_method": "fbgemm_fp8",
    "activation_scale_ub": 1200.0,
    "modules_to_not_convert": ["lm_head", "feed_forward.router"],
}


def config():
    """Hidden 64, an expert's inner width 32 (gate_up_proj [4, 64, 64], down_proj
    [4, 32, 64]), 2 layers, both MoE, vocab 128."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=EXPERTS, moe_layers=[0, 1], interleave_moe_layer_step=1,
        max_position_embeddings=64, no_rope_layers=[1, 1], attention_chunk_size=16,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip


def e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value, ties to even, saturated to +-448."""
    return x.clamp(-448.0, 448.0).to(FP8)


def scale_axis(name: str) -> int | None:
    """The axis a weight's scale groups run along (the one it reduces over): the columns of
    a matrix (a scale per row), the rows of an expert (a scale per expert and column); None
    for a tensor stored as it is."""
    if name.endswith(("gate_up_proj", "down_proj")):
        return 1
    if name.startswith("model.layers.") and name.endswith("proj.weight"):
        return -1
    return None


def scale_shape(name: str, shape: torch.Size) -> tuple[int, ...]:
    """The stored scale's shape: [R, 1]; [E, 1, C] for gate_up_proj, [E, C, 1] for
    down_proj."""
    if len(shape) == 2:
        return (shape[0], 1)
    e, _, c = shape
    return (e, 1, c) if name.endswith("gate_up_proj") else (e, c, 1)


def quantize(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn bytes and the F32 scales (`amax / 448`, 1 where amax is 0), stored shape."""
    axis = scale_axis(name)
    assert axis is not None
    amax = w.float().abs().amax(axis, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0).to(F32)
    return e4m3fn(w.float() / scale), scale.reshape(scale_shape(name, w.shape))


def value(name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spec's value: float32(W) * float32(scale), the scale broadcast over its group."""
    grid = scale.reshape(q.shape[0], 1, q.shape[2]) if q.dim() == 3 else scale.reshape(-1, 1)
    return q.to(F32) * grid.to(F32)


@dataclass
class Llama4Set:
    bf16_dir: Path
    base_dir: Path
    base: State  # as stored
    x_base: State  # the base's values (FP8 weights float32, the rest as stored)
    agent_dirs: list[Path] = field(default_factory=list)
    agents: list[State] = field(default_factory=list)
    masks: list[State] = field(default_factory=list)


def build_set(root: Path, seed: int = 0) -> Llama4Set:
    """root/bf16 (the tiny Llama-4 in bf16), root/base (it in fbgemm_fp8's form) and
    root/agent{i} (densities 1 %, 1 %, 0)."""
    from transformers import Llama4ForCausalLM

    torch.manual_seed(seed)
    model = Llama4ForCausalLM(config()).to(BF16)
    with torch.no_grad():  # experts initialised far from zero, as trained ones are
        for p in model.parameters():
            p.copy_((torch.randn(p.shape) * 0.05).to(BF16))
    model.save_pretrained(str(root / "bf16"))
    stored, x = {}, {}
    for name, t in load_checkpoint(root / "bf16").items():
        if scale_axis(name) is None:
            stored[name] = x[name] = t
            continue
        q, scale = quantize(name, t)
        stored[name], stored[name + "_scale"] = q, scale
        x[name] = value(name, q, scale)
    (root / "base").mkdir()
    save_file(stored, str(root / "base" / "model.safetensors"), {"format": "pt"})
    cfg = json.loads((root / "bf16" / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION
    (root / "base" / "config.json").write_text(json.dumps(cfg))
    s = Llama4Set(root / "bf16", root / "base", stored, x)
    model.load_state_dict({n: t.to(BF16) for n, t in x.items()})
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    first = None
    for i, density in enumerate((0.01, 0.01, 0.0)):
        masks = changes(shapes, density, seed + 10 + i, first if i == 1 else None)
        first = masks if i == 0 else first
        save_agent(model, changed(model, masks, seed + 20 + i), root / f"agent{i}")
        s.agent_dirs.append(root / f"agent{i}")
        s.agents.append(load_checkpoint(root / f"agent{i}"))
        s.masks.append(masks)
    return s


def fp8_output(s: Llama4Set, merged: State) -> State:
    """The spec's FP8 output of merged float32 values: per scale group (a row; an expert's
    column), the base's bytes and scale where y is the base's value bit for bit over the
    whole group, else `amax / 448` (F32) and e4m3fn(y / scale); the rest cast to the base's
    dtype."""
    out = {}
    for name, y in merged.items():
        axis = scale_axis(name)
        if axis is None:
            out[name] = y.to(s.base[name].dtype)
            continue
        base_s = s.base[name + "_scale"]
        x = s.x_base[name]
        same = (y.view(torch.int32) == x.view(torch.int32)).all(axis, keepdim=True)
        amax = y.abs().amax(axis, keepdim=True)
        fresh = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0).to(F32)
        scale = torch.where(same, base_s.reshape(amax.shape), fresh)
        codes = e4m3fn(y / scale).view(torch.uint8)
        out[name] = torch.where(same, s.base[name].view(torch.uint8), codes).view(FP8)
        out[name + "_scale"] = scale.reshape(base_s.shape)
    return out
