"""Tiny real checkpoints for tests, deterministic by seed, built offline.

The base is a real transformers model (so configs, tokenizer files and shard layout are what
transformers 5.x writes): that needs the test extras, so it is built here. The rest is
`ram_dist.synthetic`, shared with the demo and the benchmarks: the model's dimensions, the
RL-like sparse task vectors drawn from the base, and the files they are written to, with
plain safetensors so that tasks can be sharded differently from the base.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ram_dist.io.checkpoint import INDEX_NAME
from ram_dist.planning.config import MergeConfig
from ram_dist.synthetic.files import save_checkpoint
from ram_dist.synthetic.llama import TINY
from ram_dist.synthetic.weights import AGENT_DENSITIES, State, make_agents, make_task_state

# What the tests import from here besides this module's own builders.
__all__ = [
    "INDEX_NAME",
    "build_model_set",
    "build_tiny_base",
    "load_checkpoint",
    "make_agents",
    "make_task_state",
    "merge_config",
    "save_checkpoint",
]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


#: The dtype sets the exactness tests merge: `build_model_set` keywords by name.
DTYPE_SETS = {
    "bf16": dict(kind="llama", base_dtype=torch.bfloat16, task_dtypes=None),
    "fp16": dict(kind="qwen2", base_dtype=torch.float16, task_dtypes=None),
    "fp32": dict(kind="llama", base_dtype=torch.float32, task_dtypes=None),
    "mixed": dict(
        kind="qwen2",
        base_dtype=torch.bfloat16,
        task_dtypes=[torch.float32, torch.float16, torch.bfloat16],
    ),
}


def _tiny_config(kind: str):
    """`TINY`'s dimensions (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 256), untied."""
    from transformers import LlamaConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    return classes[kind](
        hidden_size=TINY.hidden,
        intermediate_size=TINY.intermediate,
        num_hidden_layers=TINY.layers,
        num_attention_heads=TINY.heads,
        num_key_value_heads=TINY.kv_heads,
        vocab_size=TINY.vocab,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )


def _save_tiny_tokenizer(folder: str) -> None:
    """A WordLevel tokenizer over the model's 256 tokens, so tokenizer files exist without
    the hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(TINY.vocab - len(vocab))})
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


def perturb_vectors(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Plain init leaves norms at 1 and biases at 0: move every 1-D parameter a little (from
    torch's global generator), so that every tensor is "real"."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, dtype=torch.float32).to(dtype) * 0.05)


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
    perturb_vectors(model, dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(folder), **kwargs)
    _save_tiny_tokenizer(str(folder))
    return load_checkpoint(folder)


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
    densities: tuple[float, ...] = AGENT_DENSITIES,
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


def save_shifted_tasks(
    root: Path, base: State, densities: tuple[float, ...], shift: float, generator: torch.Generator
) -> tuple[Path, list[Path]]:
    """`base` saved as root/base, and one task per density as root/t{i}: each element of the
    base moved by `shift` with that probability (in float64, stored in the base's dtype)."""
    save_checkpoint(base, root / "base")
    tasks = []
    for i, density in enumerate(densities):
        task = {
            k: torch.where(torch.rand(v.shape, generator=generator) < density,
                           v.double() + shift, v.double()).to(v.dtype)
            for k, v in base.items()
        }  # fmt: skip
        save_checkpoint(task, root / f"t{i}")
        tasks.append(root / f"t{i}")
    return root / "base", tasks


def assert_same_bytes(actual: State, expected: State) -> None:
    """The same tensor names, dtypes, shapes and bytes (the count of differing bytes said)."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        a, b = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} bytes differ"
