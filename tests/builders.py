"""Tiny real checkpoints for tests, deterministic by seed, built offline.

The base is a real transformers model (so configs, tokenizer files and shard layout are what
transformers 5.x writes); task checkpoints are RL-like sparse perturbations of it, written
with plain safetensors so they can be sharded differently from the base.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ram_dist.config import MergeConfig

State = dict[str, torch.Tensor]
INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _tiny_config(kind: str):
    """hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab 256, untied."""
    from transformers import LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind](
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )


def _save_tiny_tokenizer(folder: str) -> None:
    """A WordLevel tokenizer over 256 tokens, so tokenizer files exist without the hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(252)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build_tiny_base(
    folder: str | os.PathLike,
    kind: str = "llama",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_size: str | int | None = None,
) -> State:
    """Save a tiny Llama/Qwen2 CausalLM + tokenizer; return the stored tensors (exact bytes).

    A small max_shard_size (e.g. "100KB") gives model-0000k-of-0000K shards and an index.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    model_cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[kind]
    config = _tiny_config(kind)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    # Plain init leaves norms at 1 and biases at 0; perturb them so every tensor is "real".
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, dtype=torch.float32).to(dtype) * 0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    _save_tiny_tokenizer(str(folder))
    return load_checkpoint(folder)


def _name_seed(seed: int, name: str) -> int:
    """A stable (not hash()-randomised) generator seed per (seed, tensor name)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def make_task_state(
    base: State,
    density: float,
    seed: int,
    dtype: torch.dtype | None = None,
    scale: float = 0.02,
    mask: State | None = None,
) -> State:
    """An RL-like sparse task: theta_t = base + m * noise * scale * (|base| + 0.01).

    m ~ Bernoulli(density) per element unless `mask[name]` is given. |noise| is in [0.5, 1.5)
    with a random sign, so a 1% relative change survives bf16/fp16 storage and |tau| > 1e-5:
    the measured density stays close to `density`.
    """
    out: State = {}
    for name in sorted(base):
        b = base[name]
        if b.dtype not in FLOAT_DTYPES:
            out[name] = b.clone()
            continue
        g = torch.Generator().manual_seed(_name_seed(seed, name))
        m = torch.rand(b.shape, generator=g) < density
        if mask is not None and name in mask:
            m = mask[name].to(torch.bool)
        sign = torch.where(torch.rand(b.shape, generator=g) < 0.5, -1.0, 1.0)
        noise = sign * (0.5 + torch.rand(b.shape, generator=g))
        cdt = torch.float64 if b.dtype == torch.float64 else torch.float32
        bc = b.to(cdt)
        theta = bc + m.to(cdt) * noise.to(cdt) * scale * (bc.abs() + 0.01)
        out[name] = torch.where(m, theta, bc).to(dtype or b.dtype).contiguous()
    return out


def make_agents(
    base: State,
    densities: tuple[float, ...] = (0.03, 0.46, 0.54),
    seed: int = 1,
    dtypes: list[torch.dtype | None] | None = None,
) -> list[State]:
    """Tasks with independent masks (seed + i), so some elements are changed by 1, 2, 3 agents."""
    dtypes = dtypes or [None] * len(densities)
    return [
        make_task_state(base, p, seed + i, dtype=dt)
        for i, (p, dt) in enumerate(zip(densities, dtypes, strict=True))
    ]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_checkpoint(
    state: State,
    folder: str | os.PathLike,
    max_shard_bytes: int | None = None,
    copy_from: str | os.PathLike | None = None,
) -> None:
    """Write an HF-style checkpoint: model.safetensors, or greedy shards + index.

    Shards are filled greedily in sorted-name order; a new shard starts when the next tensor
    would overflow max_shard_bytes (a bigger tensor gets a shard of its own). copy_from copies
    the non-weight files (config, generation config, tokenizer, chat template).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if copy_from is not None:
        for src in Path(copy_from).iterdir():
            if src.is_file() and not src.name.endswith(".safetensors") and src.name != INDEX_NAME:
                shutil.copy2(src, folder / src.name)
    names = sorted(state)
    meta = {"format": "pt"}
    tensors = {n: state[n].contiguous() for n in names}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
        return
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if shards[-1] and size + _nbytes(tensors[n]) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += _nbytes(tensors[n])
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(folder / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
        "weight_map": weight_map,
    }
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_checkpoint(folder: str | os.PathLike) -> State:
    """All tensors of every *.safetensors file in `folder` (test-side only)."""
    out: State = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        part = load_file(str(f))
        dup = set(part) & set(out)
        if dup:
            raise ValueError(f"{f}: tensors already seen in another file: {sorted(dup)}")
        out.update(part)
    return out


def build_model_set(
    root: str | os.PathLike,
    kind: str = "llama",
    base_dtype: torch.dtype = torch.bfloat16,
    task_dtypes: list[torch.dtype | None] | None = None,
    densities: tuple[float, ...] = (0.03, 0.46, 0.54),
    base_shard: str | int | None = None,
    task_shard: int | None = None,
    seed: int = 0,
) -> tuple[Path, list[Path], State, list[State]]:
    """root/base and root/task{i}: (base_dir, task_dirs, base_state, task_states).

    base_shard is transformers' max_shard_size (e.g. "100KB"); task_shard is bytes for
    save_checkpoint, so tasks can be sharded differently from the base.
    """
    root = Path(root)
    base_dir = root / "base"
    base = build_tiny_base(base_dir, kind, base_dtype, seed, base_shard)
    tasks = make_agents(base, densities, seed=seed + 1, dtypes=task_dtypes)
    task_dirs = []
    for i, task in enumerate(tasks):
        task_dir = root / f"task{i}"
        save_checkpoint(task, task_dir, max_shard_bytes=task_shard, copy_from=base_dir)
        task_dirs.append(task_dir)
    return base_dir, task_dirs, base, tasks


def merge_config(base, tasks, out, options: dict | None = None, **kw: Any) -> MergeConfig:
    """A `MergeConfig` from paths or URLs, with `options` as its storage options."""
    return MergeConfig(
        base=str(base),
        tasks=tuple(map(str, tasks)),
        out=str(out),
        storage_options=options or {},
        **kw,
    )
