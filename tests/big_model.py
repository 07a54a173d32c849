"""A base and two agents whose shards are several S3 parts long (parts are at least 5 MiB).

The tiny transformers models of `builders` are one part per shard; these are plain bf16
matrices, two shards of 12 MiB each, so a multipart upload has several parts, and a third
shard that is a single small tensor (one part of a few KiB).
"""

from __future__ import annotations

from pathlib import Path

import torch
from builders import make_agents, save_checkpoint
from reference import reference_merge

State = dict[str, torch.Tensor]


def build_big_set(root: Path) -> dict:
    """root/base, root/task0, root/task1 and the reference RAM+ merge of them."""
    gen = torch.Generator().manual_seed(7)
    base: State = {
        f"layers.{i}.weight": (torch.randn(1024, 3072, generator=gen) * 0.02).to(torch.bfloat16)
        for i in range(4)
    }
    base["norm.weight"] = torch.ones(3072, dtype=torch.bfloat16)
    tasks = make_agents(base, (0.1, 0.3), seed=8)
    shard = 12 * 2**20  # two matrices a shard, and a last shard of one small tensor
    save_checkpoint(base, root / "base", max_shard_bytes=shard)
    task_dirs = []
    for i, task in enumerate(tasks):
        save_checkpoint(task, root / f"task{i}", max_shard_bytes=shard)
        task_dirs.append(root / f"task{i}")
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"base": root / "base", "tasks": task_dirs, "expected": expected}
