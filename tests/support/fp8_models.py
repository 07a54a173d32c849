"""A base and agents in fine-grained FP8 (and in bf16), small enough for every test to merge.

The FP8 weights have ragged edge blocks, and some of their blocks no agent touched: there an
FP8 agent holds the base's bytes and scales. Agents change sparse sets of elements, so the
statistics have unique and shared changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from fp8_reference import FP8, SCALE, State, block_view, dequantize, expand, quantize, write

BLOCK = (16, 8)
#: FP8 weights: ragged at the bottom and right edges, one smaller than a block, one band.
WEIGHTS = {
    "model.layers.0.mlp.down_proj.weight": (70, 45),
    "model.layers.0.self_attn.q_proj.weight": (48, 32),
    "model.layers.1.mlp.up_proj.weight": (16, 20),
    "model.layers.1.self_attn.o_proj.weight": (5, 7),
}
#: Tensors every checkpoint keeps in bf16 (as DeepSeek's norms, router and embeddings).
PLAIN = {"model.norm.weight": (45,), "model.embed_tokens.weight": (12, 45)}
#: Blocks (band, column block) of each weight that no agent changes.
UNTOUCHED = {"model.layers.0.mlp.down_proj.weight": [(0, 0), (4, 5), (2, 3)]}


@dataclass
class Fp8Set:
    base_dir: Path
    task_dirs: list[Path]
    base: State
    tasks: list[State]


#: Large enough for shards of several S3 parts (at least 5 MiB each) and many units: the
#: published 128 x 128 blocks, ragged at both edges.
LARGE_BLOCK = (128, 128)
LARGE_WEIGHTS = {f"model.layers.{i}.mlp.down_proj.weight": (1000, 3000) for i in range(6)}


def build_fp8_set(
    root: Path,
    base_format: str = "fp8",
    task_formats: tuple[str, ...] = ("fp8", "fp8", "bf16"),
    densities: tuple[float, ...] = (0.05, 0.4, 0.5),
    seed: int = 0,
    scale_dtype: torch.dtype = torch.float32,
    weights: dict[str, tuple[int, int]] | None = None,
    block: tuple[int, int] = BLOCK,
    shards: int = 2,
) -> Fp8Set:
    """root/base and root/task{i}, each "fp8" or "bf16" (an FP8 weight's values cast)."""
    g = torch.Generator().manual_seed(seed)
    values: State = {}
    for name, shape in (weights or WEIGHTS).items():
        values[name] = torch.randn(shape, generator=g) * 0.02
        values[name][0, 0] = 0.0  # a zero in a block that others change
    fp8_base: State = {}
    for name, x in values.items():
        q, s = quantize(x, block, scale_dtype)
        fp8_base[name], fp8_base[name + SCALE] = q, s
    plain = {n: (torch.randn(s, generator=g) * 0.1).to(torch.bfloat16) for n, s in PLAIN.items()}
    base_values = {n: dequantize(fp8_base[n], fp8_base[n + SCALE], block) for n in values}
    base = _stored(base_format, fp8_base, base_values, plain)
    tasks = []
    for t, (fmt, density) in enumerate(zip(task_formats, densities, strict=True)):
        tg = torch.Generator().manual_seed(seed + 100 + t)
        agent_values, agent_fp8 = {}, {}
        for name, x in base_values.items():
            mask = torch.rand(x.shape, generator=tg) < density
            bm, bn = block
            for band, col in UNTOUCHED.get(name, []):
                mask[band * bm : (band + 1) * bm, col * bn : (col + 1) * bn] = False
            delta = torch.randn(x.shape, generator=tg) * 0.01
            y = torch.where(mask, x + delta, x)
            q, s = quantize(y, block, scale_dtype)
            # Blocks this agent did not touch keep the base's bytes and scale, as a trainer
            # that never updated them would save.
            touched = block_view(mask.to(torch.int8), block).amax(dim=(2, 3)).bool()
            keep = ~expand(touched, tuple(x.shape), block)
            q = torch.where(keep, fp8_base[name].view(torch.uint8), q.view(torch.uint8)).view(FP8)
            s = torch.where(touched, s, fp8_base[name + SCALE])
            agent_fp8[name], agent_fp8[name + SCALE] = q, s
            agent_values[name] = dequantize(q, s, block)
        agent_plain = {}
        for name, p in plain.items():
            mask = torch.rand(p.shape, generator=tg) < density
            agent_plain[name] = torch.where(mask, p + 0.05, p).to(torch.bfloat16)
        tasks.append(_stored(fmt, agent_fp8, agent_values, agent_plain))
    base_dir = root / "base"
    write(base, base_dir, block if base_format == "fp8" else None, shards=shards)
    task_dirs = []
    for t, (fmt, state) in enumerate(zip(task_formats, tasks, strict=True)):
        task_dirs.append(root / f"task{t}")
        write(state, task_dirs[-1], block if fmt == "fp8" else None, shards=1 + (t + shards) % 2)
    return Fp8Set(base_dir, task_dirs, base, tasks)


def _stored(fmt: str, fp8: State, values: State, plain: State) -> State:
    if fmt == "fp8":
        return {**fp8, **plain}
    if fmt == "bf16":
        return {**{n: v.to(torch.bfloat16) for n, v in values.items()}, **plain}
    raise ValueError(fmt)


def quantize_checkpoint(
    src_dir: Path,
    out_dir: Path,
    block: tuple[int, int] = (16, 24),
    scale_dtype: torch.dtype = torch.float32,
) -> State:
    """A real transformers checkpoint (one `model.safetensors`) made fine-grained FP8: every
    2-D weight of its decoder layers quantized by blocks (`quantize`, ragged where `block`
    does not divide the shape), embeddings, norms and lm_head kept as stored, as DeepSeek's
    are; `config.json` gains the FP8 `quantization_config`; the other files are copied.
    Returns the stored state. (A PEFT adapter built on `src_dir` fits the result: same names
    and shapes.)"""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stored: State = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".layers." in name and t.ndim == 2:
            stored[name], stored[name + SCALE] = quantize(t.float(), block, scale_dtype)
        else:
            stored[name] = t
    save_file({n: stored[n].contiguous() for n in sorted(stored)},
              str(out / "model.safetensors"), {"format": "pt"})  # fmt: skip
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return stored
