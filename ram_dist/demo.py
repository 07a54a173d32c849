"""`ram-dist demo`: a tiny Llama-shaped base and three RL-like agents, merged on a local Ray.

The agents' task vectors are sparse with the densities the paper reports for RL agents
(about 3%, 46% and 54% of weights changed), drawn independently so their changes overlap
partially. Everything is generated here; nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from ram_dist.config import MergeConfig
from ram_dist.engine import driver
from ram_dist.report import format_report

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256
DENSITIES = (0.03, 0.46, 0.54)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_llama_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights with the tensor names and shapes of a 2-layer Llama."""
    g = torch.Generator().manual_seed(seed)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    shapes |= {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    state = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            state[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    return state


def agent_state(
    base: dict[str, torch.Tensor], density: float, seed: int
) -> dict[str, torch.Tensor]:
    """base + a sparse update on a `density` share of the weights (an RL-like task vector)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, b in base.items():
        mask = torch.rand(b.shape, generator=g) < density
        step = torch.randn(b.shape, generator=g) * 0.01
        out[name] = (b.float() + mask * step).to(b.dtype)
    return out


def save_model(state: dict[str, torch.Tensor], folder: str, shards: int = 1) -> None:
    """An HF-style folder: config, generation config, and one or several safetensors shards."""
    os.makedirs(folder, exist_ok=True)
    names = list(state)
    if shards == 1:
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[k * per : (k + 1) * per]}
            save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
            weight_map |= {n: file for n in part}
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f, indent=2)


def make_demo_inputs(folder: str) -> tuple[str, list[str]]:
    """Write the base (two shards) and three agents (one file each) under `folder`."""
    base = tiny_llama_state()
    base_dir = os.path.join(folder, "base")
    save_model(base, base_dir, shards=2)
    task_dirs = []
    for i, density in enumerate(DENSITIES, 1):
        task_dir = os.path.join(folder, f"agent{i}")
        save_model(agent_state(base, density, seed=100 + i), task_dir)
        task_dirs.append(task_dir)
    return base_dir, task_dirs


def run_demo(folder: str, address: str | None = None) -> dict:
    """Generate the inputs, merge them with RAM+ and print the statistics."""
    base_dir, task_dirs = make_demo_inputs(folder)
    out = os.path.join(folder, "merged")
    config = MergeConfig(
        base=base_dir, tasks=tuple(task_dirs), out=out, address=address, overwrite=True
    )
    report = driver.merge(config)
    print(format_report(report))
    print(f"\nmerged model (RAM+, r=0.1, alpha=2.0) written to {out}")
    return report
