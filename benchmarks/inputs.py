"""The benchmarks' inputs: a synthetic bf16 Llama-shaped base and three RL-like agents of a
chosen size, drawn by `ram_dist.synthetic` one shard at a time, generated once per work
folder and reused while the parameters match."""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ram_dist.synthetic.files import plan_shards, write_config, write_shards
from ram_dist.synthetic.llama import LlamaDims
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

#: Bumped whenever the same parameters would give other files (2: `ram_dist.synthetic`).
GENERATOR_VERSION = 2
DTYPE = torch.bfloat16
DTYPE_BYTES = 2


@dataclass(frozen=True)
class Models:
    """A generated set in `folder`: the model's dimensions and the shards of each checkpoint
    (the same for all of them)."""

    folder: Path
    dims: LlamaDims
    shards: list[list[str]]

    @property
    def tensors(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def inputs(self) -> list[Path]:
        """Every safetensors file of the base and the agents."""
        return [p for name in model_names() for p in safetensors_files(self.folder / name)]


def model_names() -> list[str]:
    """The folders of a set: the base first, then the agents in order."""
    return ["base"] + [f"agent{k + 1}" for k in range(len(AGENT_DENSITIES))]


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def plan_models(params: float, shard_bytes: int) -> tuple[LlamaDims, list[list[str]]]:
    """A Llama of about `params` parameters, in shards of at most `shard_bytes` filled in the
    checkpoint's order."""
    dims = LlamaDims.for_params(params)
    sizes = [(name, DTYPE_BYTES * math.prod(shape)) for name, shape in dims.tensors()]
    return dims, plan_shards(sizes, shard_bytes)


def write_model(
    folder: Path, dims: LlamaDims, shards: list[list[str]], seed: int, agent: int | None
) -> None:
    """Write the base (`agent` None) or agent `agent` (from 0), one shard in memory at a time.

    The base is drawn with `seed`, agent k with `seed + 1 + k`, as `make_agents` does."""
    shapes = dict(dims.tensors())

    def tensor(name: str) -> torch.Tensor:
        base = base_tensor(name, shapes[name], seed, DTYPE)
        if agent is None:
            return base
        return task_tensor(base, name, AGENT_DENSITIES[agent], seed + 1 + agent)

    write_shards(folder, shards, tensor, single_file=len(shards) == 1)
    write_config(folder, dims)


def _manifest_key(params: float, shard_bytes: int, seed: int) -> dict[str, Any]:
    return {
        "generator_version": GENERATOR_VERSION,
        "params": params,
        "shard_bytes": shard_bytes,
        "seed": seed,
        "densities": list(AGENT_DENSITIES),
    }


def _cached(models_dir: Path, key: dict[str, Any]) -> bool:
    manifest = models_dir / "manifest.json"
    if not manifest.is_file():
        return False
    data = json.loads(manifest.read_text())
    if data.get("key") != key:
        return False
    for rel, size in data.get("files", {}).items():
        path = models_dir / rel
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def ensure_models(workdir: Path, params: float, shard_bytes: int, seed: int) -> Models:
    """Generate base and agents under ``workdir/models`` unless an identical set is cached."""
    dims, shards = plan_models(params, shard_bytes)
    models = Models(workdir / "models", dims, shards)
    key = _manifest_key(params, shard_bytes, seed)
    if _cached(models.folder, key):
        print(f"using cached checkpoints in {models.folder}", flush=True)
        return models
    shutil.rmtree(models.folder, ignore_errors=True)
    models.folder.mkdir(parents=True)
    print(
        f"generating base + {len(AGENT_DENSITIES)} agents: {dims.params / 1e9:.3f} B params "
        f"each (hidden {dims.hidden}, {dims.layers} layers, vocab {dims.vocab}, "
        f"{len(shards)} shard(s)) in {models.folder}",
        flush=True,
    )
    for k, name in enumerate(model_names()):
        start = time.perf_counter()
        write_model(models.folder / name, dims, shards, seed, None if k == 0 else k - 1)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", flush=True)
    files = {
        str(p.relative_to(models.folder)): p.stat().st_size
        for name in model_names()
        for p in sorted((models.folder / name).iterdir())
    }
    manifest = {"key": key, "params": dims.params, "files": files}
    (models.folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return models
