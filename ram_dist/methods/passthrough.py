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

On the CPU, where the scale is 1 and the output keeps the model's dtype, the map pass is a
copy of the model's stored bytes (`fused_merge`): no float arithmetic, so a NaN's payload
(a signalling one's too) is kept bit for bit, where the eager rule's casts through float32
may quiet it or write the canonical bf16 NaN (docs/exactness.md, "NaN bytes"); every other
value's bytes are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import MergekitRule, NoStatistics, TensorParams

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
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

    def fuses(self, params: TensorParams) -> bool:
        """The map pass is a copy of the model's stored bytes where its scale is 1 and the
        output keeps its dtype; else the eager rule."""
        return all(float(s) == 1 for s in params["scale"])

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """The model's stored bytes copied into `out` where they are the rule's result (scale
        1, the output the model's dtype: the same numpy type, as the engine hands them);
        False otherwise."""
        import numpy as np

        if len(inputs) != 2:
            raise ValueError(f"passthrough takes one model, got {len(inputs) - 1}")
        task = inputs[1]
        if (
            not self.fuses(work.params)
            or not isinstance(task, np.ndarray)
            or task.dtype != out.dtype
            or task.shape != out.shape
        ):
            return False
        np.copyto(out.view(np.uint8), task.view(np.uint8))  # bytes: no float arithmetic
        return True


#: `passthrough`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Passthrough(),)
