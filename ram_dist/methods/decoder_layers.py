"""Which decoder layer a tensor belongs to: one rule for parameters that vary across layers
(mergekit's gradients) and for the per-layer statistics of the report.

mergekit takes the layer from its architecture definition (`layer_templates`), whose templates
are `model.layers.${layer_index}.…` for Llama, Qwen2, Mistral, Gemma and most decoder-only
models; other decoder layouts are `transformer.h.` (GPT-2, GPT-J, Falcon), `gpt_neox.layers.`
and `backbone.layers.`. `model.embed_tokens.weight` is a pre-layer weight, `model.norm.weight`
and `lm_head.weight` post-layer weights: outside the layers. Names of other layouts (encoders,
vision towers, multi-module models) are not layers here.
"""

from __future__ import annotations

import re

_LAYER = re.compile(
    r"^((?:model\.layers|transformer\.h|gpt_neox\.layers|backbone\.layers)\.(\d+))\."
)


def layer_index(tensor_name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for a tensor outside the layers."""
    match = _LAYER.match(tensor_name)
    return int(match.group(2)) if match else None


def layer_name(tensor_name: str) -> str | None:
    """The layer's prefix (`model.layers.3`), or None for a tensor outside the layers."""
    match = _LAYER.match(tensor_name)
    return match.group(1) if match else None
