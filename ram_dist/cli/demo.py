"""`ram-dist demo`: a tiny Llama-shaped base and three RL-like agents, merged on a local Ray.

The agents' task vectors are sparse with the densities the paper reports for RL agents
(about 3%, 46% and 54% of weights changed), drawn independently so their changes overlap
partially. Everything is generated here (`ram_dist.synthetic`, the builder the tests and the
benchmarks use too); nothing is downloaded. The inputs are made, and the job built, in the
thread that checks while Ray starts (`api.run_merge`): importing torch to write them (over a
second of CPU) and writing them overlap Ray's start instead of coming before it, and importing
this module imports neither torch nor the generator.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ram_dist.api import job_config, run_merge
from ram_dist.report.text import format_report

if TYPE_CHECKING:
    from ram_dist.planning.config import MergeConfig

#: Splits the base (209 KiB) into two shards, while each agent is one file: the merge lines
#: up checkpoints that are sharded differently.
BASE_SHARD_BYTES = 128 * 1024


def make_demo_inputs(folder: str) -> tuple[str, list[str]]:
    """Write the base (two shards) and three agents (one file each) under `folder`."""
    from ram_dist.synthetic.files import save_checkpoint, write_config  # torch
    from ram_dist.synthetic.llama import TINY
    from ram_dist.synthetic.weights import AGENT_DENSITIES, base_state, make_agents

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
    """Generate the inputs, merge them with RAM+ and print the statistics; the inputs are
    made while Ray starts (`demo_job`)."""
    report = run_merge(lambda: demo_job(folder, address), address=address).data
    print(format_report(report))
    print(f"\nmerged model (RAM+, r=0.1, alpha=2.0) written to {os.path.join(folder, 'merged')}")
    return report


def demo_job(folder: str, address: str | None = None) -> MergeConfig:
    """The demo's inputs, written under `folder`, and its job: RAM+ into `folder`/merged."""
    base_dir, task_dirs = make_demo_inputs(folder)
    out = os.path.join(folder, "merged")
    return job_config(base=base_dir, tasks=task_dirs, out=out, address=address, overwrite=True)
