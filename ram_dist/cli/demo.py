"""`ram-dist demo`: a tiny Llama-shaped base and three RL-like agents, merged on a local Ray.

The agents' task vectors are sparse with the densities the paper reports for RL agents
(about 3%, 46% and 54% of weights changed), drawn independently so their changes overlap
partially. Everything is generated here (`ram_dist.synthetic`, the builder the tests and the
benchmarks use too); nothing is downloaded.
"""

from __future__ import annotations

import os

from ram_dist.api import job_config, run_merge
from ram_dist.report.text import format_report
from ram_dist.synthetic.files import save_checkpoint, write_config
from ram_dist.synthetic.llama import TINY
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_state, make_agents

#: Splits the base (209 KiB) into two shards, while each agent is one file: the merge lines
#: up checkpoints that are sharded differently.
BASE_SHARD_BYTES = 128 * 1024


def make_demo_inputs(folder: str) -> tuple[str, list[str]]:
    """Write the base (two shards) and three agents (one file each) under `folder`."""
    base = base_state(TINY.tensors(), seed=0)
    base_dir = os.path.join(folder, "base")
    save_checkpoint(base, base_dir, max_shard_bytes=BASE_SHARD_BYTES)
    write_config(base_dir, TINY)
    task_dirs = []
    for i, agent in enumerate(make_agents(base, AGENT_DENSITIES, seed=1), 1):
        task_dir = os.path.join(folder, f"agent{i}")
        save_checkpoint(agent, task_dir, copy_from=base_dir)
        task_dirs.append(task_dir)
    return base_dir, task_dirs


def run_demo(folder: str, address: str | None = None) -> dict:
    """Generate the inputs, merge them with RAM+ and print the statistics."""
    base_dir, task_dirs = make_demo_inputs(folder)
    out = os.path.join(folder, "merged")
    config = job_config(base=base_dir, tasks=task_dirs, out=out, address=address, overwrite=True)
    report = run_merge(config).data
    print(format_report(report))
    print(f"\nmerged model (RAM+, r=0.1, alpha=2.0) written to {out}")
    return report
