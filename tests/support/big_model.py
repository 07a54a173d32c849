"""A base and two agents whose shards are several S3 parts long (parts are at least 5 MiB).

The tiny transformers models of `builders` are one part per shard; these are plain bf16
matrices, two shards of 12 MiB each, so a multipart upload has several parts, and a third
shard that is a single small tensor (one part of a few KiB).
"""

from __future__ import annotations

from pathlib import Path

from reference import reference_merge

from ram_dist.synthetic.files import save_checkpoint
from ram_dist.synthetic.weights import base_state, make_agents


def build_big_set(root: Path) -> dict:
    """root/base, root/task0, root/task1 and the reference RAM+ merge of them."""
    shapes = [(f"layers.{i}.weight", (1024, 3072)) for i in range(4)] + [("norm.weight", (3072,))]
    base = base_state(shapes, seed=7)
    tasks = make_agents(base, (0.1, 0.3), seed=8)
    shard = 12 * 2**20  # two matrices a shard, and a last shard of one small tensor
    save_checkpoint(base, root / "base", max_shard_bytes=shard)
    task_dirs = []
    for i, task in enumerate(tasks):
        save_checkpoint(task, root / f"task{i}", max_shard_bytes=shard)
        task_dirs.append(root / f"task{i}")
    expected, _ = reference_merge(base, tasks, "ram_plus")
    return {"base": root / "base", "tasks": task_dirs, "expected": expected}
