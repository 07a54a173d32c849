"""PEFT adapters written by PEFT itself, for the LoRA tests (issue 33).

Every adapter here is made the way a user's trainer makes one: the base loaded with
transformers, `get_peft_model(model, LoraConfig(...))`, the adapter's weights set, and
`PeftModel.save_pretrained`. PEFT initialises `lora_B` (and an embedding's `lora_embedding_A`)
to zeros, which would make every delta zero, so the builders set every `lora_A` / `lora_B`
(`lora_embedding_A` / `lora_embedding_B`, `lora_B.bias`) to non-zero values drawn from a
seeded generator, and move the `modules_to_save` copies away from the base. Nothing here
imports ram_dist: the bases come from `builders.build_tiny_base` (Llama, Qwen2) or
`build_tiny_gpt2` below (the Conv1D layers that need `fan_in_fan_out`).

What PEFT 0.21 writes (checked by `test_lora_reference.py`, noted in the facts file):
- `base_model.model.<module>.lora_A.weight` [r, in], `.lora_B.weight` [out, r], float32
  (PEFT keeps adapters in float32 on a bf16 base unless they are cast, as `adapter_dtype`
  does here);
- an embedding: `<module>.lora_embedding_A` [r, vocab], `<module>.lora_embedding_B`
  [dim, r] (no `.weight`), and `<module>.base_layer.weight`, the base's embedding in its dtype;
- `modules_to_save` copies under the module's plain key (`base_model.model.lm_head.weight`);
  PEFT matches them by `name.endswith(entry)`, so `"norm"` takes every `*_layernorm` too;
- `lora_bias`: `<module>.lora_B.bias` [out], saved even where the base layer has no bias
  (then PEFT only warns, and its `merge_and_unload()` fails).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

PREFIX = "base_model.model."
#: The tensor files a checkpoint folder holds; everything else of the base is copied.
_TENSOR_FILES = ("model.safetensors", "model.safetensors.index.json")


def build_tiny_gpt2(
    folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """A tiny GPT-2 (Conv1D layers, weights stored [in, out]), saved by transformers.

    Its lm_head is tied to `transformer.wte` (GPT-2's default), so no `lm_head.weight` is
    stored. 1-D tensors are moved off their plain init (ones and zeros), as the Llama builder
    does.
    """
    from builders import perturb_vectors
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(dtype)
    perturb_vectors(model, dtype)
    model.save_pretrained(str(folder))
    return Path(folder)


def build_tiny_bases(root: str | os.PathLike) -> dict[str, Path]:
    """A tiny bf16 Llama, Qwen2 and GPT-2 under `root`, by kind: the bases of every adapter
    form (`ADAPTER_FORMS` names the kind of each)."""
    from builders import build_tiny_base

    root = Path(root)
    for kind in ("llama", "qwen2"):
        build_tiny_base(root / kind, kind=kind, dtype=torch.bfloat16)
    build_tiny_gpt2(root / "gpt2")
    return {kind: root / kind for kind in ("llama", "qwen2", "gpt2")}


def _load_base(base_dir: str | os.PathLike):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto")


def _is_lora_factor(name: str) -> bool:
    return any(part in name for part in (".lora_A.", ".lora_B.", ".lora_embedding_A.",
                                         ".lora_embedding_B."))  # fmt: skip


def build_adapter(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    modules_to_save: Sequence[str] | None = None,
    lora_bias: bool = False,
    fan_in_fan_out: bool = False,
    use_dora: bool = False,
    seed: int = 0,
    adapter_dtype: torch.dtype = torch.float32,
    a_scale: float = 0.1,
    b_scale: float = 0.02,
    safe_serialization: bool = True,
) -> Path:
    """A LoRA adapter of the base in `base_dir`, saved by PEFT in `out_dir`.

    Each factor is drawn from one generator seeded by `seed`, in the order of the model's
    parameter names: `lora_A` ~ N(0, a_scale^2), `lora_B` (and `lora_B.bias`) ~
    N(0, b_scale^2), then cast to `adapter_dtype`; each `modules_to_save` copy moves by
    N(0, 0.01^2) in float32, stored in its own dtype. PEFT's warnings (a Conv1D target setting
    `fan_in_fan_out`, `lora_bias` on a layer without a bias, the embedding layer saved) are
    silenced: the tests check what is written instead.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        modules_to_save=None if modules_to_save is None else list(modules_to_save),
        lora_bias=lora_bias,
        fan_in_fan_out=fan_in_fan_out,
        use_dora=use_dora,
        lora_dropout=0.0,
    )
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = get_peft_model(_load_base(base_dir), config)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if _is_lora_factor(name):
                    scale = a_scale if ("lora_A" in name or "lora_embedding_A" in name) else b_scale
                    value = torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale
                    p.data = value.to(adapter_dtype)
                elif ".modules_to_save." in name:
                    noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.01
                    p.data = (p.data.float() + noise).to(p.dtype)
        model.save_pretrained(str(out_dir), safe_serialization=safe_serialization)
    return Path(out_dir)


def build_dora_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A DoRA adapter: `peft_type` stays "LORA", `"use_dora": true`, and a
    `<module>.lora_magnitude_vector` per target (refused by the spec)."""
    return build_adapter(base_dir, out_dir, target_modules=("q_proj",), use_dora=True)


def build_pickle_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A plain LoRA adapter saved only as `adapter_model.bin` (a pickle; refused unopened)."""
    return build_adapter(base_dir, out_dir, target_modules=("q_proj",), safe_serialization=False)


def build_loha_adapter(
    base_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0
) -> Path:
    """A LoHa adapter (`peft_type: "LOHA"`, keys `<module>.hada_w1_a` ...; refused)."""
    from peft import LoHaConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = get_peft_model(
            _load_base(base_dir), LoHaConfig(r=4, alpha=8, target_modules=["q_proj"])
        )
        model.save_pretrained(str(out_dir))
    return Path(out_dir)


def copy_side_files(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Copy the base's non-tensor files (tokenizer, generation config) that `out_dir` lacks."""
    for f in Path(base_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _TENSOR_FILES:
            if not (Path(out_dir) / f.name).exists():
                shutil.copy2(f, Path(out_dir) / f.name)


def merge_with_peft(
    base_dir: str | os.PathLike,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    safe_merge: bool = False,
    autocast_adapter_dtype: bool = True,
) -> Path:
    """The adapter merged by PEFT's own `merge_and_unload()`, saved by transformers as a full
    checkpoint folder (`save_pretrained`) with the base's tokenizer files.

    PEFT's default `autocast_adapter_dtype=True` gives the LoRA layers float32 (a bf16/fp16
    adapter is upcast, exactly). With `False` the LoRA layers take the BASE's dtype: a
    float32 adapter on a bf16 base is then ROUNDED to bf16 as it loads (not the adapter as
    saved); a bf16 adapter on a bf16 base stays as saved, and PEFT merges it on CPU as the
    spec says (B @ A in float32, rounded to bf16, then added: two roundings).
    """
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(
            _load_base(base_dir), str(adapter_dir), autocast_adapter_dtype=autocast_adapter_dtype
        )
        merged = peft_model.merge_and_unload(safe_merge=safe_merge)
        merged.save_pretrained(str(out_dir))
    copy_side_files(base_dir, out_dir)
    return Path(out_dir)


#: The adapter forms the tests cover: name -> (base kind, build_adapter keywords).
#: Base kinds: "llama" and "qwen2" (builders.build_tiny_base, bf16 unless the test says
#: otherwise) and "gpt2" (build_tiny_gpt2). Qwen2's q/k/v_proj have a bias (lora_bias).
ADAPTER_FORMS: dict[str, tuple[str, dict]] = {
    "r4_a8": ("llama", dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"))),
    "r1_a1": ("llama", dict(r=1, lora_alpha=1, target_modules=("o_proj",))),
    "r16_a32_mlp": (
        "qwen2",
        dict(r=16, lora_alpha=32, target_modules=("gate_proj", "up_proj", "down_proj")),
    ),
    "r8_a3_odd": ("llama", dict(r=8, lora_alpha=3, target_modules=("k_proj", "down_proj"))),
    "rslora": (
        "llama",
        dict(r=8, lora_alpha=16, use_rslora=True, target_modules=("q_proj", "up_proj")),
    ),
    "patterns": (
        "llama",
        dict(
            r=4,
            lora_alpha=8,
            target_modules=("q_proj", "v_proj", "down_proj"),
            rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 8},
            alpha_pattern={"q_proj": 3, "model.layers.0.mlp.down_proj": 5},
        ),
    ),
    "embedding": ("llama", dict(r=4, lora_alpha=8, target_modules=("embed_tokens", "q_proj"))),
    "modules_to_save": (
        "llama",
        dict(r=4, lora_alpha=8, target_modules=("q_proj",), modules_to_save=("lm_head", "norm")),
    ),
    "lora_bias": (
        "qwen2",
        dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), lora_bias=True),
    ),
    "fan_in_fan_out": (
        "gpt2",
        dict(r=4, lora_alpha=8, target_modules=("c_attn", "c_fc"), fan_in_fan_out=True),
    ),
    "bf16_adapter": (
        "llama",
        dict(
            r=4, lora_alpha=8, target_modules=("q_proj", "gate_proj"), adapter_dtype=torch.bfloat16
        ),
    ),  # fmt: skip
}
