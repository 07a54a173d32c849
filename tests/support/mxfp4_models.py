"""A tiny gpt-oss in bf16 and in MXFP4 (as gpt-oss ships it), and agents as RL trainers make
them, with an independent MXFP4 packer and decoder. It never imports ram_dist.

Written from `../shared/spec/ram.md` ("Other quantized bases", MXFP4): a weight `N` of shape
`[E, G*32, R]` (the experts' `gate_up_proj` and `down_proj`) is stored as `N_blocks` (uint8,
`[E, R, G, 16]`: two e2m1 codes a byte, the low nibble the even element) and `N_scales`
(uint8, `[E, R, G]`: an e8m0 exponent, biased by 127, per 32 codes of a row of the unpacked
`[E, R, G*32]`), and `N[e, c, r] = e2m1(code) * 2**(scale[e, r, c // 32] - 127)`.

- `pack`: round to nearest e2m1 (ties to the even code), with the smallest power-of-two
  scale per 32 that holds the group's largest magnitude (so a tensor of MXFP4 values packs
  back to the same values).
- `decode`: float64 products cast to float32 (exact where finite; a scale byte of 255 is NaN,
  an overflow of float32 is inf, as a plain float computation gives).
- Agents: loaded from the MXFP4 folder with `transformers` (`GptOssForCausalLM.from_pretrained`
  with `Mxfp4Config(dequantize=True)`, in bfloat16 on the CPU, so that every expert holds
  `convert_moe_packed_tensors(blocks, scales, dtype=bfloat16)`), some elements changed at
  known positions, saved with `save_pretrained` (bf16, no `quantization_config`), as a
  trainer that fine-tunes gpt-oss in bf16 does. `requantize` writes such an agent in MXFP4
  again (any input may be quantized).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

State = dict[str, torch.Tensor]
BLOCKS, SCALES = "_blocks", "_scales"
#: e2m1 magnitudes by code (bits 0-2); bit 3 is the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GROUP = 32
BIAS = 127
#: The experts' weights gpt-oss stores in MXFP4 (their biases stay plain).
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: gpt-oss's quantization_config (its `modules_to_not_convert` as the published one's).
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
#: The tiny model: hidden 64, intermediate 64 (gate_up [4, 64, 128], down [4, 64, 64]).
CONFIG = dict(
    hidden_size=64,
    intermediate_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=8,
    tie_word_embeddings=False,
)


def is_mxfp4_weight(name: str) -> bool:
    return name.endswith(EXPERT_WEIGHTS)


# ---- the format --------------------------------------------------------------------------


def _exponent(q: torch.Tensor) -> torch.Tensor:
    """The least integer e with q <= 2**e, for q > 0 (float64, exact: frexp)."""
    m, x = torch.frexp(q)  # q = m * 2**x, 0.5 <= m < 1
    return torch.where(m == 0.5, x - 1, x)


def pack(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, R, G, 16], scales [E, R, G]) of `values` ([E, G*32, R], any float dtype):
    per 32 elements of a row of the unpacked [E, R, G*32], the smallest scale 2**s with
    amax <= 6 * 2**s (s in [-127, 127]; an all-zero group takes 2**-127), each element
    rounded to the nearest e2m1 value times it, ties to the even code."""
    e, c, r = values.shape
    assert c % GROUP == 0, values.shape
    x = values.to(torch.float64).transpose(1, 2).reshape(e, r, c // GROUP, GROUP)
    amax = x.abs().amax(-1)
    s = torch.where(amax > 0, _exponent(amax / 6.0), -BIAS).clamp(-BIAS, BIAS)
    q = x / torch.ldexp(torch.ones_like(amax), s)[..., None]  # exact: a power of two
    grid = torch.tensor(E2M1, dtype=torch.float64)
    distance = (q.abs()[..., None] - grid).abs()  # exact near a midpoint (Sterbenz)
    index = distance.argmin(-1)  # the first of two at the same distance: the lower code
    tie = (distance == distance.min(-1, keepdim=True).values).sum(-1) > 1
    index = torch.where(tie & (index % 2 == 1), index + 1, index)  # ties to the even code
    code = (index | torch.where(torch.signbit(q), 8, 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (s + BIAS).to(torch.uint8).contiguous()


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values [E, G*32, R] of an MXFP4 weight, straight from the spec's formula:
    each code's e2m1 value times 2**(scale - 127) in float64 (exact), cast to float32; a
    scale byte of 255 gives NaN."""
    e, r, g, _ = blocks.shape
    codes = torch.empty((e, r, g, GROUP), dtype=torch.int64)
    codes[..., 0::2] = (blocks & 0x0F).to(torch.int64)
    codes[..., 1::2] = (blocks >> 4).to(torch.int64)
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    value = torch.where(codes >= 8, -magnitude, magnitude)
    exponent = scales.to(torch.int64)[..., None] - BIAS
    value = value * torch.pow(torch.tensor(2.0, dtype=torch.float64), exponent)
    value = torch.where(scales[..., None] == 255, torch.nan, value)
    return value.to(torch.float32).reshape(e, r, g * GROUP).transpose(1, 2).contiguous()


def values(stored: State) -> State:
    """x: each MXFP4 weight decoded to float32 (by its name without `_blocks`), the rest as
    stored."""
    out = {}
    for name, t in stored.items():
        if name.endswith(BLOCKS):
            weight = name[: -len(BLOCKS)]
            out[weight] = decode(t, stored[weight + SCALES])
        elif not name.endswith(SCALES):
            out[name] = t
    return out


def write_mxfp4(state: State, src: Path, out: Path) -> State:
    """`state` (plain tensors, the experts' weights MXFP4 values or not) saved in `out` as an
    MXFP4 checkpoint: the experts' weights packed, config.json from `src` with gpt-oss's
    quantization_config, `src`'s other files copied. Returns the stored tensors."""
    stored: State = {}
    for name, t in state.items():
        if is_mxfp4_weight(name):
            stored[name + BLOCKS], stored[name + SCALES] = pack(t)
        else:
            stored[name] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: stored[n] for n in sorted(stored)}, str(out / "model.safetensors"),
              {"format": "pt"})  # fmt: skip
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return stored


# ---- the models --------------------------------------------------------------------------


def _config():
    from transformers import GptOssConfig

    return GptOssConfig(**CONFIG)


def build_base(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """root/bf16: a tiny GptOss saved in bfloat16 whose experts' weights are MXFP4 values
    (so it is the MXFP4 base dequantized); root/mxfp4: its MXFP4 copy. Every 1-D parameter
    (biases, norms, sinks) is moved a little from its init. Returns both folders."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(_config()).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):
                p.add_((torch.randn(p.shape) * 0.05).to(p.dtype))
            if is_mxfp4_weight(name):
                p.copy_(decode(*pack(p)).to(p.dtype))  # exact in bf16
    model.save_pretrained(str(root / "bf16"))
    write_mxfp4(load_file(str(root / "bf16" / "model.safetensors")), root / "bf16",
                root / "mxfp4")  # fmt: skip
    return root / "bf16", root / "mxfp4"


def load_as_trainer(mxfp4_dir: Path):
    """The MXFP4 base as a trainer loads it: dequantized to bfloat16 by transformers."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    return GptOssForCausalLM.from_pretrained(
        str(mxfp4_dir), dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )


def save_unchanged(mxfp4_dir: Path, out: Path, dtype: torch.dtype) -> None:
    """An agent that changed nothing, trained in `dtype`: the MXFP4 base loaded by
    transformers dequantized to `dtype`, saved by `save_pretrained`."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM.from_pretrained(
        str(mxfp4_dir), dtype=dtype, quantization_config=Mxfp4Config(dequantize=True)
    )
    model.save_pretrained(str(out))


def changes(
    shapes: dict[str, torch.Size], density: float, seed: int, share: State | None = None
) -> State:
    """Per tensor, the elements an agent changes: each with probability `density`, and half
    of those `share` marks (another agent's), so that some changes are shared."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        mask = torch.rand(shape, generator=g) < density
        if share is not None:
            mask |= share[name] & (torch.rand(shape, generator=g) < 0.5)
        out[name] = mask
    return out


def changed(model, masks: State, seed: int, step: float = 0.05) -> State:
    """The model's floating parameters with the elements of `masks` moved by +-`step` (added
    in float32, rounded to the parameter's dtype: a change in bf16 at these magnitudes)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        mask = masks.get(name)
        if mask is None or not p.is_floating_point():
            out[name] = p.clone()
            continue
        sign = torch.where(torch.rand(p.shape, generator=g) < 0.5, -1.0, 1.0)
        moved = (p.float() + sign * step).to(p.dtype)
        out[name] = torch.where(mask, moved, p)
    return out


def save_agent(model, state: State, out: Path) -> None:
    """The model saved by `save_pretrained` with `state` as its parameters (then restored)."""
    saved = {n: p.detach().clone() for n, p in model.state_dict().items()}
    model.load_state_dict(state)
    model.save_pretrained(str(out))
    model.load_state_dict(saved)


@dataclass
class GptOssSet:
    """A tiny gpt-oss base in bf16 and MXFP4, and agents of the MXFP4 one."""

    bf16_dir: Path
    base_dir: Path  # the MXFP4 base
    base: State  # as stored: blocks and scales
    x_base: State  # the base's values: MXFP4 weights decoded (float32), the rest as stored
    agent_dirs: list[Path] = field(default_factory=list)
    agents: list[State] = field(default_factory=list)  # as stored (bf16)
    masks: list[State] = field(default_factory=list)  # per agent: the elements it changed
    requantized_dir: Path | None = None  # the first agent again, in MXFP4
    requantized: State | None = None  # as stored


def build_set(
    root: Path, densities: tuple[float, ...] = (0.01, 0.01, 0.0), seed: int = 0
) -> GptOssSet:
    """root/bf16, root/mxfp4 (`build_base`), root/agent{i}: agents trained from the MXFP4 base
    as transformers loads it, each changing about `densities[i]` of every floating tensor's
    elements (the second also half of the first's; a density of 0 an agent saved unchanged),
    and root/agent0-mxfp4: the first agent quantized to MXFP4 again."""
    bf16_dir, base_dir = build_base(root, seed)
    base = load_file(str(base_dir / "model.safetensors"))
    s = GptOssSet(bf16_dir, base_dir, base, values(base))
    model = load_as_trainer(base_dir)
    shapes = {n: p.shape for n, p in model.state_dict().items() if p.is_floating_point()}
    first = None
    for i, density in enumerate(densities):
        masks = changes(shapes, density, seed + 10 + i, first if i == 1 else None)
        first = masks if i == 0 else first
        out = root / f"agent{i}"
        save_agent(model, changed(model, masks, seed + 20 + i), out)
        s.agent_dirs.append(out)
        s.agents.append(load_file(str(out / "model.safetensors")))
        s.masks.append(masks)
    s.requantized_dir = root / "agent0-mxfp4"
    s.requantized = write_mxfp4(s.agents[0], s.agent_dirs[0], s.requantized_dir)
    return s
