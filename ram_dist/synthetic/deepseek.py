"""The tensors, shards and `config.json` of DeepSeek-V3 (671B, FP8): only the names, shapes,
dtypes and files, no weights.

Built from the published `config.json` of `deepseek-ai/DeepSeek-V3`: hidden 7168, 61 decoder
layers, the first 3 dense (`first_k_dense_replace`, intermediate 18432), the other 58 with 256
routed experts and 1 shared expert (`moe_intermediate_size` 2048) and a router (`mlp.gate.weight`
[256, 7168] BF16, `mlp.gate.e_score_correction_bias` [256] F32); multi-head latent attention
(q_lora_rank 1536, kv_lora_rank 512, 128 heads, qk_nope_head_dim 128, qk_rope_head_dim 64,
v_head_dim 128); vocabulary 129280, `model.embed_tokens` and `lm_head` untied; and the
multi-token-prediction module as layer 61 (`num_nextn_predict_layers` 1): a full MoE decoder
layer plus `enorm`, `hnorm`, `eh_proj` [7168, 14336], `embed_tokens`, `shared_head.norm` and
`shared_head.head`. The names are those of the published `model.safetensors.index.json`.

Every linear weight of the decoder layers (attention projections, dense MLP, experts, shared
expert) is stored as `F8_E4M3` with a companion `<name>_scale_inv`: F32, one scale per block of
128 x 128 (`weight_block_size`), shape [ceil(rows / 128), ceil(cols / 128)]. The norms, the
router, the embeddings, `lm_head` and the MTP module's own weights (`eh_proj`, `shared_head`)
are BF16, as published. In all, 91,991 tensors, 45,808 of them FP8, 684,531,386,000 elements.

Shards (`shards`): the tensors in the published grouping (the embedding, layers 0 to 60 in
order, `model.norm` and `lm_head`, then layer 61 with the MTP module's own weights last, so
that, as published, the embedding is in the first file, `lm_head` a few files before the end
and the MTP weights in the last), cut into 163 files of about equal bytes (4.2 GB; a tensor
goes to the file its first byte falls in), `model-00001-of-000163.safetensors` and so on, as
DeepSeek names them. Within a file the tensors are ordered as Hugging Face's safetensors
writer orders them: by element size, largest first (F32, then BF16, then F8_E4M3), then by
name. The published files' exact split differs a little.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ram_dist.dtypes import itemsize

Shape = tuple[int, ...]
Tensor = tuple[str, Shape, str]
"""`(name, shape, safetensors dtype)`."""

FP8 = "F8_E4M3"
#: The published `quantization_config` of DeepSeek-V3.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


@dataclass(frozen=True)
class V3Dims:
    """The sizes of DeepSeek-V3's architecture (`DeepseekV3ForCausalLM`), DeepSeek-V3's
    published ones by default: what `decoder_layer` and `v3_config` read. Kimi-K2 is this
    architecture at other sizes (`ram_dist.synthetic.kimi.KimiDims`)."""

    hidden: int = 7168
    intermediate: int = 18432
    moe_intermediate: int = 2048
    layers: int = 61
    dense_layers: int = 3
    routed_experts: int = 256
    shared_experts: int = 1
    experts_per_token: int = 8
    heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab: int = 129280


@dataclass(frozen=True)
class DeepSeekDims(V3Dims):
    """DeepSeek-V3's dimensions (the defaults are the published ones)."""

    mtp_layers: int = 1
    block: int = 128
    shard_count: int = 163

    def _linear(self, name: str, rows: int, cols: int) -> list[Tensor]:
        """An FP8 weight and its block scales."""
        scales = (math.ceil(rows / self.block), math.ceil(cols / self.block))
        return [(name, (rows, cols), FP8), (name + "_scale_inv", scales, "F32")]

    def _mlp(self, prefix: str, inner: int) -> list[Tensor]:
        h = self.hidden
        return [
            *self._linear(prefix + "gate_proj.weight", inner, h),
            *self._linear(prefix + "up_proj.weight", inner, h),
            *self._linear(prefix + "down_proj.weight", h, inner),
        ]

    def layer(self, n: int) -> list[Tensor]:
        """The tensors of decoder layer `n` (dense below `dense_layers`, else MoE)."""
        return decoder_layer(
            self, n, self._linear, lambda prefix, inner, _: self._mlp(prefix, inner)
        )

    def mtp_extras(self, n: int) -> list[Tensor]:
        """The multi-token-prediction module's own weights of layer `n` (BF16)."""
        h, v, p = self.hidden, self.vocab, f"model.layers.{n}."
        return [
            (p + "enorm.weight", (h,), "BF16"),
            (p + "hnorm.weight", (h,), "BF16"),
            (p + "eh_proj.weight", (h, 2 * h), "BF16"),
            (p + "embed_tokens.weight", (v, h), "BF16"),
            (p + "shared_head.norm.weight", (h,), "BF16"),
            (p + "shared_head.head.weight", (v, h), "BF16"),
        ]

    def tensors(self) -> list[Tensor]:
        """Every tensor, in the published grouping (see the module docstring)."""
        h, v = self.hidden, self.vocab
        out: list[Tensor] = [("model.embed_tokens.weight", (v, h), "BF16")]
        for n in range(self.layers):
            out += self.layer(n)
        out += [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (v, h), "BF16")]
        for n in range(self.layers, self.layers + self.mtp_layers):
            out += self.layer(n) + self.mtp_extras(n)
        return out

    def shards(self) -> list[list[Tensor]]:
        """`tensors()` in `shard_count` files of about equal bytes, each file's tensors in the
        order of Hugging Face's safetensors writer (element size descending, then name)."""
        shards = split_evenly(self.tensors(), self.shard_count)
        return [sorted(s, key=lambda t: (-itemsize(t[2]), t[0])) for s in shards]

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors())

    def config(self) -> dict[str, Any]:
        """The published `config.json` (the fields that describe the weights and the model)."""
        published = v3_config(
            self, "deepseek_v3", (8, 4, 2.5), self.mtp_layers, {"max_position_embeddings": 163840}
        )
        tokens = {"bos_token_id": 0, "eos_token_id": 1}
        return {**published, **tokens, "quantization_config": dict(QUANTIZATION_CONFIG)}


def v3_config(
    dims: V3Dims,
    model_type: str,
    routing: tuple[int, int, float],
    mtp_layers: int,
    positions: dict[str, Any],
) -> dict[str, Any]:
    """The `config.json` of DeepSeek-V3's architecture at `dims`, in the published file's
    order up to `torch_dtype`: the fields of the sizes, and a model's own values that describe
    no tensor: `routing` (n_group, topk_group, routed_scaling_factor), its multi-token-
    prediction layers and `positions` (max_position_embeddings, then RoPE's fields if any)."""
    groups, topk_groups, scaling = routing
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": model_type,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "moe_intermediate_size": dims.moe_intermediate,
        "num_hidden_layers": dims.layers,
        "first_k_dense_replace": dims.dense_layers,
        "moe_layer_freq": 1,
        "n_routed_experts": dims.routed_experts,
        "n_shared_experts": dims.shared_experts,
        "num_experts_per_tok": dims.experts_per_token,
        "n_group": groups,
        "topk_group": topk_groups,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": scaling,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.heads,
        "q_lora_rank": dims.q_lora_rank,
        "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": dims.qk_nope_head_dim,
        "qk_rope_head_dim": dims.qk_rope_head_dim,
        "v_head_dim": dims.v_head_dim,
        "num_nextn_predict_layers": mtp_layers,
        "vocab_size": dims.vocab,
        **positions,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def decoder_layer(
    dims: V3Dims,
    n: int,
    linear: Callable[[str, int, int], list[Tensor]],
    mlp: Callable[[str, int, bool], list[Tensor]],
) -> list[Tensor]:
    """The tensors of decoder layer `n` of DeepSeek-V3's architecture (Kimi-K2's too), in the
    published order: MLA attention, then a dense MLP below `dims.dense_layers`, else the
    router, the routed experts and the shared one. `linear(name, rows, cols)`: an attention
    projection's stored tensors; `mlp(prefix, inner, routed)`: an MLP's (`routed`: an
    expert of the router's)."""
    h, p = dims.hidden, f"model.layers.{n}."
    a = p + "self_attn."
    q_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    kv_a = dims.kv_lora_rank + dims.qk_rope_head_dim
    kv_b = dims.heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    out: list[Tensor] = [
        (p + "input_layernorm.weight", (h,), "BF16"),
        *linear(a + "q_a_proj.weight", dims.q_lora_rank, h),
        (a + "q_a_layernorm.weight", (dims.q_lora_rank,), "BF16"),
        *linear(a + "q_b_proj.weight", dims.heads * q_head, dims.q_lora_rank),
        *linear(a + "kv_a_proj_with_mqa.weight", kv_a, h),
        (a + "kv_a_layernorm.weight", (dims.kv_lora_rank,), "BF16"),
        *linear(a + "kv_b_proj.weight", kv_b, dims.kv_lora_rank),
        *linear(a + "o_proj.weight", h, dims.heads * dims.v_head_dim),
        (p + "post_attention_layernorm.weight", (h,), "BF16"),
    ]
    if n < dims.dense_layers:
        return out + mlp(p + "mlp.", dims.intermediate, False)
    out += [
        (p + "mlp.gate.weight", (dims.routed_experts, h), "BF16"),
        (p + "mlp.gate.e_score_correction_bias", (dims.routed_experts,), "F32"),
    ]
    for e in range(dims.routed_experts):
        out += mlp(f"{p}mlp.experts.{e}.", dims.moe_intermediate, True)
    shared = dims.moe_intermediate * dims.shared_experts
    return out + mlp(p + "mlp.shared_experts.", shared, False)


def shard_name(k: int, count: int) -> str:
    """DeepSeek's name of file `k` (from 1) of `count`: `model-00001-of-000163.safetensors`."""
    return f"model-{k:05d}-of-{count:06d}.safetensors"


def split_evenly(tensors: list[Tensor], count: int) -> list[list[Tensor]]:
    """`count` shards of consecutive tensors, about equal in bytes: a tensor goes to the shard
    its first byte falls in. Refused when a shard would be empty (a tensor larger than a
    shard's share)."""
    sizes = [math.prod(shape) * itemsize(dtype) for _, shape, dtype in tensors]
    total = sum(sizes)
    shards: list[list[Tensor]] = [[] for _ in range(count)]
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        shards[min(count - 1, offset * count // total)].append(tensor)
        offset += size
    if not all(shards):
        raise ValueError("an empty shard: the layout does not fit the shard count")
    return shards


#: DeepSeek-V3 as published.
DEEPSEEK_V3 = DeepSeekDims()
