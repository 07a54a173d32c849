"""The tensors and `config.json` of a Llama-shaped model, with Hugging Face's
`LlamaForCausalLM` names: only the names, shapes and counts, no weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]


@dataclass(frozen=True)
class LlamaDims:
    """A Llama's dimensions; the embedding and `lm_head` are untied."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        """Rows of `k_proj` and `v_proj`: head size times KV heads."""
        return self.hidden // self.heads * self.kv_heads

    def tensors(self) -> list[tuple[str, Shape]]:
        """`(name, shape)` of every tensor, in the order of a Hugging Face checkpoint."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors())

    def config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """A minimal `config.json`: enough for mergekit and transformers to know the model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    @classmethod
    def for_params(cls, params: float) -> LlamaDims:
        """Dimensions whose parameter count is close to `params`: head size 64, four query
        heads per KV head, intermediate 8/3 of hidden, as many layers as the budget holds."""
        hidden = min(8192, _round64(math.sqrt(params / 300)))
        heads = hidden // 64
        kv_heads = max(1, heads // 4)
        vocab = 32000 if params >= 1e8 else 8000
        one = cls(hidden, _round64(hidden * 8 / 3), 1, heads, kv_heads, vocab)
        fixed = 2 * vocab * hidden + hidden
        layers = max(1, round((params - fixed) / (one.params - fixed)))
        return cls(hidden, one.intermediate, layers, heads, kv_heads, vocab)


def _round64(x: float) -> int:
    return max(64, int(round(x / 64)) * 64)


#: The model of the demo and of the tests: hidden 64, 2 layers, 4 heads, 2 KV heads.
TINY = LlamaDims(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
#: Llama-3.1-405B's layout (126 layers, hidden 16384, 128 heads, 8 KV heads).
LLAMA_3_1_405B = LlamaDims(
    hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, vocab=128256
)
