"""Tiny float32 models for the geometric methods' engine tests: a Llama base and four
models around it, task 0 near (slerp's linear branch), tasks 1-3 far (spherical branches)."""

from __future__ import annotations

from pathlib import Path

import torch
from builders import build_tiny_base, save_checkpoint

SPREADS = (0.01, 0.6, 0.9, 0.75)


def build_geometric_models(
    root: Path, dtype: torch.dtype = torch.float32
) -> tuple[Path, list[Path], dict, list[dict]]:
    """root/base and root/task{i} in `dtype`: (base_dir, task_dirs, base_state, task_states);
    task i moves each tensor by `SPREADS[i]` times its standard deviation, at random."""
    base = build_tiny_base(root / "base", "llama", dtype, 7, "100KB")
    gen = torch.Generator().manual_seed(8)
    tasks, dirs = [], []
    for i, spread in enumerate(SPREADS):
        task = {}
        for name, x in base.items():
            scale = float(x.float().std()) if x.numel() > 1 else 1.0
            step = spread * max(scale, 1e-3) * torch.randn(x.shape, generator=gen)
            task[name] = (x.float() + step).to(dtype)
        save_checkpoint(task, root / f"task{i}", copy_from=root / "base")
        tasks.append(task)
        dirs.append(root / f"task{i}")
    return root / "base", dirs, base, tasks
