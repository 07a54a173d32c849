"""Supervised training of the base, on-policy GRPO-style RL of the agents, and evaluation."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from rl_model import completion_mask, decode, generate, prompt_ids
from rl_tasks import BOS, EOS, PAD, TASKS, CharTokenizer, Task, TrainStream


def sft_batch(pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids `[BOS] prompt answer [EOS]` right-padded with PAD, and labels that are -100
    everywhere but the answer and its EOS (the loss is on the answer only)."""
    tok = CharTokenizer()
    rows, labels = [], []
    for prompt, answer in pairs:
        p, a = [BOS, *tok.encode(prompt)], [*tok.encode(answer), EOS]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, y) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(y)] = torch.tensor(y)
    return ids, lab


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sft(
    model: torch.nn.Module,
    seed: int,
    steps: int,
    batch: int,
    lr: float,
    exclude: dict[str, set[str]],
    mixture: tuple[str, ...] = (),
    callback=None,
) -> dict:
    """Supervised training on a mixture of the tasks: one task per step, cycling through
    `mixture` (default: every task once, an equal mixture).
    `callback(step, model)`, if given, runs after every step."""
    torch.manual_seed(seed)
    streams = {name: TrainStream(task, seed, exclude[name]) for name, task in TASKS.items()}
    names = list(mixture or TASKS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, max(1, steps // 20))
        ids, lab = sft_batch(streams[names[step % len(names)]].demonstrations(batch))
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if callback is not None:
            callback(step + 1, model)
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return {"steps": steps, "final_loss": sum(tail) / len(tail), "wall_s": time.perf_counter() - t0}


def completion_logprobs(
    model: torch.nn.Module, prompts: torch.Tensor, completions: torch.Tensor
) -> torch.Tensor:
    """log pi(token) of every completion token given the prompt and the tokens before it."""
    full = torch.cat([prompts, completions], dim=1)
    logits = model(input_ids=full).logits[:, prompts.shape[1] - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1)


def grpo(
    policy: torch.nn.Module,
    task: Task,
    seed: int,
    steps: int,
    prompts_per_step: int,
    group: int,
    lr: float,
    exclude: set[str],
    temperature: float = 1.0,
    callback=None,
) -> dict:
    """On-policy policy gradient with a group baseline (GRPO with one update per batch, so
    the importance ratio is 1 and clipping never acts; no KL term, no supervised target).

    Weights: an fp32 master copy is what Adam updates; the policy that samples, and through
    which the gradient is taken, holds the master rounded to bf16 (in float32 tensors). The
    saved agent is that bf16 policy. A master change smaller than half a bf16 step never
    reaches the policy. `callback(step, policy, rewards)`, if given, runs after every update
    (the learning rate is constant, so the policy after n updates is the agent of an n-step
    run)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    stream = TrainStream(task, seed, exclude)
    params = [p for p in policy.parameters()]
    master = [p.detach().clone().float().requires_grad_(False) for p in params]
    opt = torch.optim.Adam(master, lr=lr, betas=(0.9, 0.99), eps=1e-8)
    rewards_log: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        examples = stream.batch(prompts_per_step)  # the answers go to the verifier only
        answers = [a for _, a, _ in examples for _ in range(group)]
        prompts = prompt_ids([p for p, _, _ in examples]).repeat_interleave(group, dim=0)
        policy.eval()
        completions = generate(
            policy, prompts, task.max_answer + 1, temperature=temperature, generator=gen
        )
        texts = decode(completions)
        rewards = torch.tensor([task.score(t, a) for t, a in zip(texts, answers, strict=True)])
        rewards_log.append(float(rewards.mean()))
        r = rewards.view(prompts_per_step, group)
        adv = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)
        mask = completion_mask(completions)
        logp = completion_logprobs(policy, prompts, completions)
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        policy.zero_grad(set_to_none=True)
        loss.backward()
        for p, m in zip(params, master, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().float()
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m.to(torch.bfloat16).float())
        if callback is not None:
            callback(step + 1, policy, rewards_log)
    policy.eval()
    return {"steps": steps, "train_reward": rewards_log, "wall_s": time.perf_counter() - t0}


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task, pairs: list[tuple[str, str]], batch: int) -> float:
    """Greedy decoding; the mean verifier score over the held-out pairs."""
    total = 0.0
    for i in range(0, len(pairs), batch):
        some = pairs[i : i + batch]
        comp = generate(model, prompt_ids([p for p, _ in some]), task.max_answer + 1)
        total += sum(task.score(t, a) for t, (_, a) in zip(decode(comp), some, strict=True))
    return total / len(pairs)
