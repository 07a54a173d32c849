"""The tensors, shards and `config.json` of Kimi-K2-Thinking (1.03T parameters, INT4 experts):
only the names, shapes, dtypes and files, no weights.

Built from the published `config.json` of `moonshotai/Kimi-K2-Thinking`, which is DeepSeek-V3's
architecture (`DeepseekV3ForCausalLM`) at other sizes: hidden 7168, 61 decoder layers, the
first dense (`first_k_dense_replace` 1, intermediate 18432), the other 60 with 384 routed
experts and 1 shared expert (`moe_intermediate_size` 2048) and a router (`mlp.gate.weight`
[384, 7168] BF16, `mlp.gate.e_score_correction_bias` [384] F32, as DeepSeek-V3 stores them);
multi-head latent attention (64 heads, 64 KV heads, q_lora_rank 1536, kv_lora_rank 512,
qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128); vocabulary 163840,
`model.embed_tokens` and `lm_head` untied (`tie_word_embeddings` false); `torch_dtype`
bfloat16. Unlike DeepSeek-V3 it has no multi-token-prediction layer and no FP8 tensor. The
names are DeepSeek-V3's (`ram_dist.synthetic.deepseek`). The routing fields of `config()`
beyond those (8 experts a token, one group, `routed_scaling_factor` 2.827), its 262,144
positions, its RoPE and its token ids are the values reported for Kimi-K2, not read from the
published file; they describe no tensor.

In the published (base) checkpoint only the routed experts' linear weights are quantized, INT4
as compressed-tensors packs it (`quant_method: compressed-tensors`, `format: pack-quantized`;
the published `quantization_config`, `QUANTIZATION_CONFIG`: 4-bit symmetric integers, one
scale per group of 32 along the input, every module that is not a routed expert ignored). Each
`model.layers.{n}.mlp.experts.{e}.{gate,up,down}_proj` of layers 1 to 60 is stored as the
triple `N.weight_packed` (I32 [out, in / 8]: eight 4-bit codes per int32), `N.weight_scale`
(BF16 [out, in / 32]) and `N.weight_shape` (I32 [2], the decoded [out, in]), and no zero point:
gate and up are [2048, 7168] decoded, down [7168, 2048]. Everything else (attention, the dense
MLP, the shared experts, the router, the norms, the embedding and `lm_head`) is BF16 but the
router's correction bias (F32). In all 208,215 stored tensors (207,360 of them in the 69,120
triples) and 594,205,904,896 bytes, computed here from the shapes (not the published index's
`total_size`, which was not checked); 1,026,408,232,448 parameters, counting each INT4 weight
by its decoded elements: Kimi-K2's "1T total", 1.01T of it the routed experts.

An agent trained from it (`int4=False`) is what `transformers` saves of the model loaded in
bf16: the same tensors but each triple, which is the decoded `N.weight` (BF16 [out, in]), and no
`quantization_config`: 69,975 tensors, 2,052,816,510,976 bytes, in 412 files. These names and
shapes are those `transformers`' `DeepseekV3ForCausalLM` saves (its experts fused in memory,
saved one by one); the router keeps the base's dtypes here, where that class would keep
`mlp.gate.weight` in F32 too.

Shards (`shards`): the tensors in DeepSeek-V3's grouping (the embedding, layers 0 to 60 in
order, `model.norm` and `lm_head`), cut into 62 files of about equal bytes (9.6 GB; a tensor
goes to the file its first byte falls in), `model-00001-of-000062.safetensors` to
`model-00062-of-000062.safetensors` as Moonshot names them (the published listing of
Kimi-K2-Thinking has these 62 files; the 64 of Kimi-K2.5 and K2.6 add a vision tower). An
agent's are `model-00001-of-00NNN.safetensors`, as `save_pretrained` names them, in shards of
at most 5 GB filled in the same order. Within a file the tensors are ordered as Hugging Face's
safetensors writer orders them: by element size, largest first, then by name. The published
files' exact split differs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from ram_dist.synthetic.deepseek import Tensor, V3Dims, decoder_layer, v3_config
from ram_dist.synthetic.files import in_files

#: The published `quantization_config` of Kimi-K2-Thinking.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "pack-quantized",
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "block_structure": None,
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "sparsity_config": {},
}
#: The three stored tensors of an INT4 weight `N`, after `N.`.
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
#: 4-bit codes per int32 of `weight_packed`.
PACK = 8
#: Inputs per scale of `weight_scale`.
GROUP = 32


@dataclass(frozen=True)
class KimiDims(V3Dims):
    """Kimi-K2-Thinking's dimensions (the defaults are the published ones; those not named
    here are DeepSeek-V3's)."""

    dense_layers: int = 1
    routed_experts: int = 384
    heads: int = 64
    vocab: int = 163840
    shard_count: int = 62

    def _expert_linear(self, module: str, rows: int, cols: int, int4: bool) -> list[Tensor]:
        """A routed expert's weight [rows, cols]: the INT4 triple, or BF16 `module.weight`."""
        if not int4:
            return [(module + ".weight", (rows, cols), "BF16")]
        if cols % GROUP:
            raise ValueError(f"{module}: {cols} inputs are not whole groups of {GROUP}")
        return [
            (module + ".weight_packed", (rows, cols // PACK), "I32"),
            (module + ".weight_scale", (rows, cols // GROUP), "BF16"),
            (module + ".weight_shape", (2,), "I32"),
        ]

    def _mlp(self, prefix: str, inner: int, int4: bool | None = None) -> list[Tensor]:
        """gate, up and down of an MLP: BF16 (`int4` None), or a routed expert's."""
        h = self.hidden
        shapes = (("gate_proj", inner, h), ("up_proj", inner, h), ("down_proj", h, inner))
        if int4 is None:
            return [(f"{prefix}{m}.weight", (r, c), "BF16") for m, r, c in shapes]
        return [t for m, r, c in shapes for t in self._expert_linear(prefix + m, r, c, int4)]

    def layer(self, n: int, int4: bool = True) -> list[Tensor]:
        """The tensors of decoder layer `n` (dense below `dense_layers`, else MoE): the base's
        (`int4`), or an agent's in bf16."""

        def mlp(prefix: str, inner: int, routed: bool) -> list[Tensor]:
            return self._mlp(prefix, inner, int4 if routed else None)

        return decoder_layer(self, n, lambda name, r, c: [(name, (r, c), "BF16")], mlp)

    def tensors(self, int4: bool = True) -> list[Tensor]:
        """Every stored tensor, in DeepSeek-V3's grouping (see the module docstring): the
        base's (`int4`), or an agent's in bf16."""
        h, v = self.hidden, self.vocab
        out: list[Tensor] = [("model.embed_tokens.weight", (v, h), "BF16")]
        for n in range(self.layers):
            out += self.layer(n, int4)
        return out + [("model.norm.weight", (h,), "BF16"), ("lm_head.weight", (v, h), "BF16")]

    def shards(self, int4: bool = True) -> list[list[Tensor]]:
        """`tensors(int4)` in files, each file's tensors in the order of Hugging Face's
        safetensors writer (element size descending, then name): the base's `shard_count`
        of about equal bytes, an agent's of at most `files.AGENT_SHARD_BYTES` filled greedily."""
        return in_files(self.tensors(int4), self.shard_count if int4 else None)

    @property
    def params(self) -> int:
        """Parameters of the model (an INT4 weight counted by its decoded elements)."""
        return sum(math.prod(shape) for _, shape, _ in self.tensors(int4=False))

    def config(self, int4: bool = True) -> dict[str, Any]:
        """The published `config.json` (the fields that describe the weights and the model);
        without `quantization_config` for an agent (`int4` False)."""
        positions = {"max_position_embeddings": 262144, "rope_theta": 50000.0}
        out = v3_config(self, "kimi_k2", (1, 1, 2.827), 0, positions)
        out.update(bos_token_id=163584, eos_token_id=163585)
        if int4:
            out["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
        return out


#: Kimi-K2-Thinking as published.
KIMI_K2_THINKING = KimiDims()
