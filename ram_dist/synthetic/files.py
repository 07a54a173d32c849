"""Hugging Face style checkpoint folders, from tensors in memory or drawn one shard at a time,
and sparse ones that hold only the headers (for planning at full scale without the bytes)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ram_dist.dtypes import itemsize
from ram_dist.io.names import INDEX_NAME, MODEL_CONFIG_NAME, SINGLE_NAME
from ram_dist.io.writer import OutTensor, shard_header
from ram_dist.synthetic.deepseek import Tensor, split_evenly
from ram_dist.synthetic.llama import LlamaDims

METADATA = {"format": "pt"}


def shard_name(k: int, count: int) -> str:
    """The name of shard `k` (from 1) of `count`: `model-0000k-of-0000K.safetensors`."""
    return f"model-{k:05d}-of-{count:05d}.safetensors"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Names in shards, filled greedily in the given order: a new shard starts when the next
    tensor would overflow `max_shard_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes:
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


#: The most bytes `save_pretrained` puts in one of an agent's shards.
AGENT_SHARD_BYTES = 5 * 10**9


def in_files(tensors: list[Tensor], count: int | None) -> list[list[Tensor]]:
    """`tensors` in files, each file's tensors in the order of Hugging Face's safetensors
    writer (element size descending, then name): `count` files of about equal bytes (a
    published base's), or, for None, files of at most `AGENT_SHARD_BYTES` filled greedily
    (an agent's, as `save_pretrained` cuts them)."""
    if count is not None:
        shards = split_evenly(tensors, count)
    else:
        by_name = {t[0]: t for t in tensors}
        sizes = [(t[0], math.prod(t[1]) * itemsize(t[2])) for t in tensors]
        shards = [[by_name[n] for n in s] for s in plan_shards(sizes, AGENT_SHARD_BYTES)]
    return [sorted(s, key=lambda t: (-itemsize(t[2]), t[0])) for s in shards]


def write_shards(
    folder: str | os.PathLike,
    shards: Sequence[Sequence[str]],
    tensor_of: Callable[[str], torch.Tensor],
    single_file: bool = False,
) -> None:
    """Write the tensors `tensor_of(name)` of `shards`, one shard in memory at a time.

    `single_file`: one shard, as `model.safetensors` with no index; otherwise
    `model-0000k-of-0000K.safetensors` files and `model.safetensors.index.json`.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if single_file:
        if len(shards) != 1:
            raise ValueError(f"single_file needs one shard, got {len(shards)}")
        tensors = {n: tensor_of(n).contiguous() for n in shards[0]}
        save_file(tensors, str(folder / SINGLE_NAME), metadata=METADATA)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        file = shard_name(k, len(shards))
        tensors = {n: tensor_of(n).contiguous() for n in shard}
        save_file(tensors, str(folder / file), metadata=METADATA)
        weight_map |= dict.fromkeys(shard, file)
        total += sum(nbytes(t) for t in tensors.values())
        del tensors
    _write_index(folder, weight_map, total)


def save_checkpoint(
    state: dict[str, torch.Tensor],
    folder: str | os.PathLike,
    max_shard_bytes: int | None = None,
    copy_from: str | os.PathLike | None = None,
) -> None:
    """Write `state` as `model.safetensors`, or (with `max_shard_bytes`) as shards filled in
    sorted-name order (`plan_shards`) and an index. `copy_from` copies the non-weight files
    (config, generation config, tokenizer, chat template) of another folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if copy_from is not None:
        for src in Path(copy_from).iterdir():
            if src.is_file() and not src.name.endswith(".safetensors") and src.name != INDEX_NAME:
                shutil.copy2(src, folder / src.name)
    names = sorted(state)
    if max_shard_bytes is None:
        write_shards(folder, [names], state.__getitem__, single_file=True)
    else:
        shards = plan_shards(((n, nbytes(state[n])) for n in names), max_shard_bytes)
        write_shards(folder, shards, state.__getitem__)


def write_config(folder: str | os.PathLike, dims: LlamaDims, dtype: str = "bfloat16") -> None:
    """`config.json` and `generation_config.json` of a Llama of `dims`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MODEL_CONFIG_NAME).write_text(json.dumps(dims.config(dtype), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_sparse_checkpoint(
    folder: str | os.PathLike,
    shards: Sequence[Sequence[tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], str]]],
    dtype: str = "BF16",
    config: dict[str, Any] | None = None,
    name: Callable[[int, int], str] = shard_name,
) -> None:
    """Shards of `(name, shape)` or `(name, shape, dtype)` tensors (safetensors dtypes such as
    BF16, F32, F8_E4M3; `dtype` for those without one) as sparse files: each shard's real
    safetensors header, then `truncate` to its full size (the tensor bytes are a hole), and
    the index. `config`, where given, is written as `config.json`; `name(k, count)` names
    shard `k` (from 1) of `count`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / MODEL_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards, start=1):
        file = name(k, len(shards))
        out = [OutTensor(t[0], t[2] if len(t) > 2 else dtype, tuple(t[1])) for t in tensors]
        header = shard_header(out)
        data = sum(t.nbytes for t in out)
        with open(folder / file, "wb") as f:
            f.write(header)
        os.truncate(folder / file, len(header) + data)
        weight_map |= dict.fromkeys((t.name for t in out), file)
        total += data
    _write_index(folder, weight_map, total)


def _write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
