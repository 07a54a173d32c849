"""The model: a small Qwen2-shaped decoder built with `transformers`, saved as safetensors.

Weights on disk are bfloat16 (the base and every agent). For compute they are loaded into
float32 tensors: a bf16 value is exact in float32, so the model computes with exactly the
saved weights, and CPU float32 matmuls are fast and deterministic with one thread.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch
from rl_tasks import BOS, EOS, PAD, VOCAB_SIZE, CharTokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


def build_config(size: Size) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=96,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        use_cache=True,
    )


def new_model(size: Size, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config(size))
    return model.float().eval()


def save(model: Qwen2ForCausalLM, folder: str, extra: dict | None = None) -> None:
    """An HF folder: config.json (dtype bfloat16), model.safetensors in bf16, the character
    tokenizer as tokenizer.json (see the README), and training.json (how it was made)."""
    os.makedirs(folder, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(CharTokenizer().to_json(), f, indent=1)
    if extra:
        with open(os.path.join(folder, "training.json"), "w", encoding="utf-8") as f:
            json.dump(extra, f, indent=1)


def load(folder: str) -> Qwen2ForCausalLM:
    """The saved bf16 weights, in float32 tensors (exact), ready for inference."""
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return model.float().eval()


def prompt_ids(prompts: list[str]) -> torch.Tensor:
    """[BOS] + characters; every prompt of a batch has the same length (one task)."""
    tok = CharTokenizer()
    rows = [[BOS, *tok.encode(p)] for p in prompts]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("prompts of one batch must have the same length")
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def generate(
    model: Qwen2ForCausalLM,
    prompts: torch.Tensor,
    max_new: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Completions (batch x max_new token ids), greedy when temperature is 0, else sampled.
    A row that has emitted EOS continues with PAD. Uses the KV cache."""
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    tokens = []
    for step in range(max_new):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        tokens.append(nxt)
        done = done | (nxt == EOS)
        if bool(done.all()) or step == max_new - 1:
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    return torch.stack(tokens, dim=1)


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """1.0 for every generated token up to and including the first EOS, else 0.0."""
    is_eos = (completions == EOS).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS seen strictly before this position
    return (before == 0).float()


def decode(completions: torch.Tensor) -> list[str]:
    tok = CharTokenizer()
    return [tok.decode(row.tolist()) for row in completions]
