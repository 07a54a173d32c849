"""mergekit's `nearswap` (`NearSwap`, listed in `METHODS`): take the task model's value
where it is near the base's, interpolate towards the base where it is farther.

Per element, in float32 (`a` the base, `b` the one task model):
`w = clamp(reciprocal(max(|a - b|, 1e-6)) * t, 0, 1)`, then `w * b + (1 - w) * a`.
mergekit writes the weight as `t / absdiff.clamp(min=1e-6)`; torch evaluates a Python
scalar divided by a tensor as `reciprocal(x) * t`, two roundings, so it is written here
that way, op by op: the bytes are mergekit's. A rule of each element alone (no statistics),
so any chunking gives the same bytes; each op is one IEEE rounding on any device. On the
CPU the map pass is a fused kernel (`kernels/blend_numba.nearswap`), op for op this rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import MergekitRule, NoStatistics, TensorParams
from ram_dist.methods.task_vectors import task_values

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork

#: mergekit's floor of |base - model| before its reciprocal.
MIN_DISTANCE = 1e-6


#: mergekit's `t`, without a default (a merge must give it).
T = Parameter(
    "t", None, "distance scale: the model's value is taken where |base - model| <= t",
    cli_flag="--nearswap-t",
)  # fmt: skip


def merge_chunk(base: torch.Tensor, task: torch.Tensor, t: float) -> torch.Tensor:
    """nearswap's merged float32 values of one chunk."""
    import torch

    a, (b,) = task_values(base, [task])
    distance = torch.abs(a - b).clamp(min=MIN_DISTANCE)
    weight = (torch.reciprocal(distance) * t).clamp(min=0, max=1)
    return weight * b + (1 - weight) * a


@dataclass(frozen=True)
class NearSwap(MergekitRule, NoStatistics):
    """mergekit's `nearswap`: a base and one task model, blended element by element."""

    name: str = "nearswap"
    label: str = "NearSwap"
    summary: str = "NearSwap: one model's values where they lie within about t of the base's"
    reference: str = "alchemonaut, QuartetAnemoi-70B-t0.0001 (Hugging Face)"
    task_counts: tuple[int, int | None] = (1, 1)
    reads_stored: bool = True
    """Its kernel reads quantized inputs as stored."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (T,)

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        params = work.params
        if len(tasks) != 1:
            raise ValueError(f"nearswap merges one task model into the base, got {len(tasks)}")
        return merge_chunk(base, tasks[0], float(params["t"]))

    def fuses(self, params: TensorParams) -> bool:
        """The kernel takes every chunk."""
        return True

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype by its kernel, written into `out`; False
        where numba is missing."""
        from ram_dist import kernels

        kernel = kernels.numba_module("blend_numba")
        if kernel is None:
            return False
        if len(inputs) != 2:
            raise ValueError(f"nearswap merges one task model into the base, got {len(inputs) - 1}")
        base, task = inputs
        t = float(work.params["t"])
        kernel.nearswap(base, task, out, t=t, floor=MIN_DISTANCE, bf16_nan=work.bf16_nan)
        return True


#: `nearswap`, as `ram_dist.methods.METHODS` lists it.
METHODS = (NearSwap(),)
