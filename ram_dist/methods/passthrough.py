"""mergekit's `passthrough` (`Passthrough`, listed in `METHODS`): one model's tensors as they
are, each optionally times its `scale`.

mergekit's passthrough takes exactly one input (it is the tool of `slices:` frankenmerges,
which ram-dist does not read) and multiplies a tensor by the model's `scale` where one is
set (`tensor * scale`: one float32 rounding, here too). Without a scale (mergekit's default,
None) the values are the model's own: here the default is 1, and a scale of 1 is no
multiplication at all, so the bytes are the same.

The job's base (`--base`, or a config's first model when it has no `base_model`) gives the
output's layout, as for `linear`; the one task (`--task`) is the model passed through. A
config `models: [{model: M, parameters: {scale: ...}}]` with no `base_model` takes M for
both. The base's values are never used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import MergekitRule, NoStatistics

if TYPE_CHECKING:
    import torch

    from ram_dist.methods.protocol import ChunkWork

SCALE = Parameter(
    "scale", 1.0, "multiply the model's tensors by this", per_task=True,
    cli_flag="--scale",
)  # fmt: skip


def merge_chunk(task: torch.Tensor, scale: float) -> torch.Tensor:
    """The model's values in float32, times `scale` unless it is 1."""
    import torch

    x = task.to(torch.float32)
    return x if scale == 1 else x * scale


@dataclass(frozen=True)
class Passthrough(MergekitRule, NoStatistics):
    """mergekit's `passthrough`: one model, optionally scaled."""

    name: str = "passthrough"
    label: str = "Passthrough"
    summary: str = "one model's tensors as they are, each optionally times its scale"
    needs_base: bool = False
    task_counts: tuple[int, int | None] = (1, 1)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (SCALE,)

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        params = work.params
        if len(tasks) != 1:
            raise ValueError(f"passthrough takes one model, got {len(tasks)}")
        return merge_chunk(tasks[0], float(params["scale"][0]))


#: `passthrough`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Passthrough(),)
