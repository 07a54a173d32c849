"""Task vectors measured against the base at each task's precision (docs/exactness.md), in
torch: the rule every method's eager path forms its updates by.

`tau_t = cdt(theta_t) - cdt(theta_B^t)` with `theta_B^t = cast(x_B, p_t)`: a task stored in
bfloat16 or float16 is measured against the base's value rounded to that dtype (what a
trainer that loaded the base in that dtype started from), any other task against the base's
value itself. Where every input of a tensor has one dtype, `theta_B^t` is the base and
nothing changes. The merged output is built on `x_B`, the base's own value.

`ram_dist.kernels.precision` is the same rule in numpy (for the methods' numpy paths), and
`ram_dist.kernels.primitives.load_tile_bases` in the fused kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def narrows(base: torch.Tensor, task: torch.Tensor) -> bool:
    """Whether `task` measures its update against the base rounded to its dtype: it is
    bfloat16 or float16, and the base is not of that dtype."""
    import torch

    return task.dtype in (torch.bfloat16, torch.float16) and task.dtype != base.dtype


def base_at(base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    """`theta_B^t`: the base at `task`'s precision (RNE, as `torch.Tensor.to` casts; from a
    float64 base through float32, as torch casts), or the base itself."""
    return base.to(task.dtype) if narrows(base, task) else base


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input of the tensor is float64, else float32 (the spec)."""
    import torch

    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def task_vectors(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The base in the compute dtype (`dtype`, float32 by default) and each task's update,
    `dtype(theta_t) - dtype(theta_B^t)`: one rounding."""
    import torch

    cdt = torch.float32 if dtype is None else dtype
    b = base.to(cdt)
    return b, [t.to(cdt) - (base_at(base, t).to(cdt) if narrows(base, t) else b) for t in tasks]


def task_values(
    base: torch.Tensor, tasks: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The base in float32 and each task's float32 values as a method that blends values
    (slerp, nearswap, model_stock's mean) takes them: the task's own where its update is
    measured against the base itself, else `x_B + tau_t` (one rounding), so that an element
    the task never touched is the base's value."""
    import torch

    b = base.to(torch.float32)
    out = []
    for t in tasks:
        value = t.to(torch.float32)
        out.append(b + (value - base_at(base, t).to(torch.float32)) if narrows(base, t) else value)
    return b, out
