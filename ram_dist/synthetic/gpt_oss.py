"""The tensors, shards and `config.json` of gpt-oss (120b by default, MXFP4 experts): only the
names, shapes, dtypes and files, no weights.

Built from the published `config.json` and `model.safetensors.index.json` of
`openai/gpt-oss-120b`: hidden 2880, 36 decoder layers, each with attention (64 query heads
and 8 KV heads of 64, `q_proj`, `k_proj`, `v_proj` and `o_proj` with their biases, and one
attention sink per head, `self_attn.sinks` [64]), a router (`mlp.router.weight` [128, 2880]
and its bias) and 128 experts whose weights are stacked in one tensor each:
`mlp.experts.gate_up_proj` [E, hidden, 2 * intermediate] and `mlp.experts.down_proj`
[E, intermediate, hidden] (intermediate 2880), with their biases `gate_up_proj_bias`
[E, 2 * intermediate] and `down_proj_bias` [E, hidden]; the vocabulary is 201088,
`model.embed_tokens` and `lm_head` untied. 116,829,156,672 parameters.

In the published (base) checkpoint the two expert weights are MXFP4 (`kernels.mxfp4`): the
weight `N` is stored as `N_blocks` (U8 [E, R, G, 16]) and `N_scales` (U8 [E, R, G]), where
`N` is [E, G*32, R]: `gate_up_proj_blocks` [128, 5760, 90, 16] and `down_proj_blocks`
[128, 2880, 90, 16]. Everything else, the experts' biases and the sinks included, is BF16:
687 stored tensors, 65,248,815,744 bytes, the published index's `total_size`. `config.json`
has the published `quantization_config` (`quant_method: mxfp4`).

An agent trained from it (`mxfp4=False`) is what `transformers` saves of the model loaded in
bf16: the same names but the pairs, which are the decoded `N` (BF16 [E, G*32, R]), and no
`quantization_config`.

Shards (`shards`): the tensors in the published grouping (the layers in the string order of
their numbers, 0, 1, 10, 11, ..., 19, 2, 20, ..., each layer's tensors in the index's order,
then `model.embed_tokens`, `model.norm` and `lm_head`, so that the embedding and `lm_head`
are in the last file), cut into 15 files of about equal bytes (4.35 GB; a tensor goes to the
file its first byte falls in), named `model-00000-of-00014.safetensors` to
`model-00014-of-00014.safetensors` as gpt-oss names them (from 0, "of" the last number).
An agent's are `model-00001-of-000NN.safetensors`, as `save_pretrained` names them, in shards
of at most 5 GB filled in the same order. Within a file the tensors are ordered as Hugging
Face's safetensors writer orders them: by element size, largest first, then by name. The
published files' exact split differs a little.

`GptOssDims.for_params` gives a gpt-oss-shaped model of a chosen size (the benchmarks').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ram_dist.synthetic.deepseek import Tensor
from ram_dist.synthetic.files import in_files

#: The published `quantization_config` of gpt-oss.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
#: Codes per e8m0 scale, and per 16-byte block row.
GROUP = 32
#: The decoded names of the MXFP4 weights of a layer, after `model.layers.{n}.`.
MXFP4_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class GptOssDims:
    """gpt-oss's dimensions (the defaults are gpt-oss-120b's)."""

    hidden: int = 2880
    intermediate: int = 2880
    layers: int = 36
    experts: int = 128
    experts_per_token: int = 4
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    shard_count: int = 15

    def _expert_weight(self, name: str, rows: int, cols: int, mxfp4: bool) -> list[Tensor]:
        """An expert weight of value [E, rows, cols]: MXFP4 blocks and scales, or BF16."""
        if not mxfp4:
            return [(name, (self.experts, rows, cols), "BF16")]
        groups = rows // GROUP
        return [
            (name + "_blocks", (self.experts, cols, groups, GROUP // 2), "U8"),
            (name + "_scales", (self.experts, cols, groups), "U8"),
        ]

    def layer(self, n: int, mxfp4: bool = True) -> list[Tensor]:
        """The tensors of decoder layer `n`, in the published index's order."""
        h, i, e, p = self.hidden, self.intermediate, self.experts, f"model.layers.{n}."
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        a, x = p + "self_attn.", p + "mlp.experts."
        return [
            (p + "input_layernorm.weight", (h,), "BF16"),
            (a + "o_proj.bias", (h,), "BF16"),
            (a + "o_proj.weight", (h, q), "BF16"),
            (a + "q_proj.bias", (q,), "BF16"),
            (a + "k_proj.bias", (kv,), "BF16"),
            (a + "v_proj.bias", (kv,), "BF16"),
            (a + "q_proj.weight", (q, h), "BF16"),
            (a + "k_proj.weight", (kv, h), "BF16"),
            (a + "v_proj.weight", (kv, h), "BF16"),
            (a + "sinks", (self.heads,), "BF16"),
            (p + "mlp.router.bias", (e,), "BF16"),
            (p + "mlp.router.weight", (e, h), "BF16"),
            (x + "gate_up_proj_bias", (e, 2 * i), "BF16"),
            *self._expert_weight(x + "gate_up_proj", h, 2 * i, mxfp4),
            (x + "down_proj_bias", (e, h), "BF16"),
            *self._expert_weight(x + "down_proj", i, h, mxfp4),
            (p + "post_attention_layernorm.weight", (h,), "BF16"),
        ]

    def tensors(self, mxfp4: bool = True) -> list[Tensor]:
        """Every stored tensor, in the published grouping (see the module docstring): the
        base's (`mxfp4`), or an agent's in bf16."""
        out: list[Tensor] = []
        for n in sorted(range(self.layers), key=str):
            out += self.layer(n, mxfp4)
        h, v = self.hidden, self.vocab
        return out + [
            ("model.embed_tokens.weight", (v, h), "BF16"),
            ("model.norm.weight", (h,), "BF16"),
            ("lm_head.weight", (v, h), "BF16"),
        ]

    def shards(self, mxfp4: bool = True) -> list[list[Tensor]]:
        """`tensors(mxfp4)` in files, each file's tensors in the order of Hugging Face's
        safetensors writer (element size descending, then name): the base's `shard_count`
        of about equal bytes, an agent's of at most `files.AGENT_SHARD_BYTES` filled greedily."""
        return in_files(self.tensors(mxfp4), self.shard_count if mxfp4 else None)

    @property
    def params(self) -> int:
        """Parameters of the model (an MXFP4 weight counted by its decoded elements)."""
        return sum(math.prod(shape) for _, shape, _ in self.tensors(mxfp4=False))

    def config(self, mxfp4: bool = True) -> dict[str, Any]:
        """The published `config.json` (the fields that describe the weights and the model);
        without `quantization_config` for an agent (`mxfp4` False)."""
        out: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "layer_types": [
                "sliding_attention" if n % 2 == 0 else "full_attention" for n in range(self.layers)
            ],
            "sliding_window": 128,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_local_experts": self.experts,
            "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token,
            "vocab_size": self.vocab,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eos_token_id": 200002,
            "pad_token_id": 199999,
        }
        if mxfp4:
            out["quantization_config"] = dict(QUANTIZATION_CONFIG)
        return out

    @classmethod
    def for_params(cls, params: float, experts: int = 32) -> GptOssDims:
        """A gpt-oss-shaped model of about `params` parameters, for benchmarks: `experts`
        experts (gpt-oss-20b's 32), intermediate equal to hidden (a multiple of 64, so of
        MXFP4's 32), heads of 64 with one KV head per 8 query heads, a vocabulary of 32,000
        (8,000 below 1e8 parameters), and as many layers as the budget holds."""
        hidden = max(64, int(round(math.sqrt(params / 1000) / 64)) * 64)
        heads = hidden // 64
        vocab = 32000 if params >= 1e8 else 8000
        one = cls(hidden, hidden, 1, experts, min(4, experts), heads, max(1, heads // 8), 64,
                  vocab, 1)  # fmt: skip
        fixed = 2 * vocab * hidden + hidden
        layers = max(1, round((params - fixed) / (one.params - fixed)))
        return cls(hidden, hidden, layers, experts, one.experts_per_token, heads,
                   one.kv_heads, 64, vocab, 1)  # fmt: skip


def shard_name(k: int, count: int) -> str:
    """gpt-oss's name of file `k` (from 1) of `count`: from 0, "of" the last number, as
    `model-00000-of-00014.safetensors` is the first of 15."""
    return f"model-{k - 1:05d}-of-{count - 1:05d}.safetensors"


#: gpt-oss-120b as published.
GPT_OSS_120B = GptOssDims()
