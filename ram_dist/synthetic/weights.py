"""Random weights: a base, and RL-like agents fine-tuned from it.

RL fine-tuning changes a sparse share of the weights, different for each agent and partly
overlapping (the paper reports about 3 %, 46 % and 54 % for three agents). An agent here
changes each weight of the base independently with probability `density`, by 1 % to 3 % of
its magnitude plus a little: enough to survive rounding to bf16 or fp16 and to exceed the
merge's `eps = 1e-5`, so the density a merge measures is close to the one asked for.

Every tensor has its own generator, seeded from `(seed, name)`: a tensor's values do not
depend on the other tensors, so a large model can be drawn one tensor at a time.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

State = dict[str, torch.Tensor]
#: The task-vector densities of the paper's three RL agents.
AGENT_DENSITIES = (0.03, 0.46, 0.54)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def name_seed(seed: int, name: str) -> int:
    """A stable (not hash()-randomised) generator seed per (seed, tensor name)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def base_tensor(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """`0.02 * N(0, 1)`, or `1 + 0.05 * N(0, 1)` for a norm's weight (a name ending in
    `norm.weight`, as RMSNorm weights start at 1)."""
    g = torch.Generator().manual_seed(name_seed(seed, name))
    x = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        return x.mul_(0.05).add_(1.0).to(dtype)
    return x.mul_(0.02).to(dtype)


def base_state(
    tensors: Iterable[tuple[str, tuple[int, ...]]], seed: int, dtype: torch.dtype = torch.bfloat16
) -> State:
    """`base_tensor` of every `(name, shape)`."""
    return {name: base_tensor(name, shape, seed, dtype) for name, shape in tensors}


def task_tensor(
    base: torch.Tensor,
    name: str,
    density: float,
    seed: int,
    dtype: torch.dtype | None = None,
    scale: float = 0.02,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One tensor of an RL-like agent: `base + m * noise * scale * (|base| + 0.01)`.

    m ~ Bernoulli(density) per element unless `mask` is given. |noise| is in [0.5, 1.5)
    with a random sign, so a 1% relative change survives bf16/fp16 storage and |tau| > 1e-5.
    A tensor that is not floating point is copied unchanged.
    """
    if base.dtype not in FLOAT_DTYPES:
        return base.clone()
    g = torch.Generator().manual_seed(name_seed(seed, name))
    m = torch.rand(base.shape, generator=g) < density
    if mask is not None:
        m = mask.to(torch.bool)
    sign = torch.where(torch.rand(base.shape, generator=g) < 0.5, -1.0, 1.0)
    noise = torch.rand(base.shape, generator=g).add_(0.5).mul_(sign)
    cdt = torch.float64 if base.dtype == torch.float64 else torch.float32
    bc = base.to(cdt)
    # In place, in the order of `bc + noise * scale * (|bc| + 0.01)`; kept only where m is.
    theta = noise.to(cdt).mul_(scale).mul_(bc.abs().add_(0.01)).add_(bc)
    return torch.where(m, theta, bc).to(dtype or base.dtype).contiguous()


def make_task_state(
    base: State,
    density: float,
    seed: int,
    dtype: torch.dtype | None = None,
    scale: float = 0.02,
    mask: State | None = None,
) -> State:
    """`task_tensor` of every tensor of `base`; `mask[name]`, where given, replaces the
    random choice of changed elements."""
    return {
        name: task_tensor(base[name], name, density, seed, dtype, scale, (mask or {}).get(name))
        for name in sorted(base)
    }


def make_agents(
    base: State,
    densities: tuple[float, ...] = AGENT_DENSITIES,
    seed: int = 1,
    dtypes: list[torch.dtype | None] | None = None,
) -> list[State]:
    """Tasks with independent masks (seed + i), so some elements are changed by 1, 2, 3 agents."""
    dtypes = dtypes or [None] * len(densities)
    return [
        make_task_state(base, p, seed + i, dtype=dt)
        for i, (p, dt) in enumerate(zip(densities, dtypes, strict=True))
    ]
