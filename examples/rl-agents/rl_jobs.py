"""The pipeline's jobs, each run in a worker process with one torch thread.

Every job is a pure function of its arguments (seeds included), so the results do not depend
on which worker runs it or in what order.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import rl_model
import torch
from rl_model import Size
from rl_tasks import TASKS, held_out
from rl_train import evaluate, grpo, sft


@dataclass(frozen=True)
class Plan:
    """Everything the pipeline does, for one seed; the same for every method."""

    size: Size
    sft_steps: int
    sft_batch: int
    sft_lr: float
    sft_mixture: tuple[str, ...]
    """The task of each supervised step, in turn."""
    rl_steps: int
    rl_prompts: int
    rl_group: int
    rl_lr: float
    eval_n: int
    eval_batch: int = 256
    seeds: tuple[int, ...] = (0, 1, 2)
    extra_merges: tuple[tuple[str, tuple[str, ...]], ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return asdict(self)


def init_worker() -> None:
    """One thread per worker process: on a shared 2-core machine two single-thread
    workers are far faster than one two-thread worker (no spinning at thread barriers)."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _held_out(plan: Plan, seed: int) -> dict[str, list[tuple[str, str]]]:
    return {name: held_out(task, plan.eval_n, seed) for name, task in TASKS.items()}


def _exclude(plan: Plan, seed: int) -> dict[str, set[str]]:
    return {name: {p for p, _ in pairs} for name, pairs in _held_out(plan, seed).items()}


def sft_job(plan: Plan, seed: int, folder: str) -> dict:
    """Train the base on the mixture of all tasks and save it in bf16."""
    t0 = time.perf_counter()
    model = rl_model.new_model(plan.size, seed)
    info = sft(
        model,
        seed,
        plan.sft_steps,
        plan.sft_batch,
        plan.sft_lr,
        _exclude(plan, seed),
        plan.sft_mixture,
    )
    info["parameters"] = sum(p.numel() for p in model.parameters())
    rl_model.save(model, folder, {"stage": "sft", "seed": seed, **info})
    info["wall_s"] = time.perf_counter() - t0
    return info


def rl_job(plan: Plan, seed: int, task_name: str, base: str, folder: str) -> dict:
    """Train one agent from the base on one task by GRPO and save it in bf16."""
    t0 = time.perf_counter()
    policy = rl_model.load(base)
    # A seed per (pipeline seed, task), so the three agents see different samples.
    rl_seed = 1000 * (seed + 1) + sorted(TASKS).index(task_name)
    info = grpo(
        policy,
        TASKS[task_name],
        rl_seed,
        plan.rl_steps,
        plan.rl_prompts,
        plan.rl_group,
        plan.rl_lr,
        _exclude(plan, seed)[task_name],
    )
    rl_model.save(policy, folder, {"stage": "grpo", "task": task_name, "seed": seed, **info})
    info["wall_s"] = time.perf_counter() - t0
    return info


def rl_snapshots_job(
    plan: Plan, seed: int, task_name: str, base: str, lr: float, folders: dict[int, str]
) -> dict:
    """One GRPO run of `max(folders)` updates at learning rate `lr`, saving the bf16 agent
    after each number of updates in `folders` (the regime sweep's agents). The RL seed is
    `rl_job`'s, so the snapshot at `plan.rl_steps` and `plan.rl_lr` is the main run's agent."""
    t0 = time.perf_counter()
    policy = rl_model.load(base)
    rl_seed = 1000 * (seed + 1) + sorted(TASKS).index(task_name)
    saved: dict[int, float] = {}

    def snapshot(step: int, model: torch.nn.Module, rewards: list[float]) -> None:
        if step in folders:
            meta = {"stage": "grpo", "task": task_name, "seed": seed, "lr": lr, "steps": step}
            rl_model.save(model, folders[step], {**meta, "train_reward": list(rewards)})
            saved[step] = time.perf_counter() - t0

    info = grpo(
        policy,
        TASKS[task_name],
        rl_seed,
        max(folders),
        plan.rl_prompts,
        plan.rl_group,
        lr,
        _exclude(plan, seed)[task_name],
        callback=snapshot,
    )
    info.update(wall_s=time.perf_counter() - t0, saved_at_s=saved, lr=lr)
    return info


def eval_job(plan: Plan, seed: int, folder: str) -> dict:
    """Scores of the model in `folder` on every task's held-out set (greedy)."""
    t0 = time.perf_counter()
    model = rl_model.load(folder)
    pairs = _held_out(plan, seed)
    scores = {
        name: evaluate(model, task, pairs[name], plan.eval_batch) for name, task in TASKS.items()
    }
    return {"scores": scores, "wall_s": time.perf_counter() - t0, "folder": os.fspath(folder)}


def bf16_steps(base: str, agent: str, eps: float = 1e-5) -> dict:
    """How far the agent's changed weights moved, in bf16 steps (units in the last place):
    the share of the elements with |tau| > eps (the probe's rule) that moved 1, 2, 3-4, 5-16
    and more than 16 representable bf16 values away from the base's."""
    from safetensors.torch import load_file

    a_all = load_file(os.path.join(agent, "model.safetensors"))
    b_all = load_file(os.path.join(base, "model.safetensors"))
    edges = [(1, 1), (2, 2), (3, 4), (5, 16), (17, 1 << 16)]
    counts = [0] * len(edges)
    changed = total = 0
    for name, b in b_all.items():
        a = a_all[name]
        total += b.numel()
        mask = (a.float() - b.float()).abs() > eps
        changed += int(mask.sum())

        def ordered(x: torch.Tensor) -> torch.Tensor:
            bits = x.view(torch.int16).int() & 0xFFFF
            mag = bits & 0x7FFF
            return torch.where(bits >> 15 == 1, -mag, mag)

        steps = (ordered(a) - ordered(b)).abs()[mask]
        for i, (lo, hi) in enumerate(edges):
            counts[i] += int(((steps >= lo) & (steps <= hi)).sum())
    labels = ["1", "2", "3-4", "5-16", ">16"]
    return {
        "density": changed / total,
        "share_by_steps": {k: c / max(1, changed) for k, c in zip(labels, counts, strict=True)},
    }
