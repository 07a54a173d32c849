"""mergekit's `linear` (`LinearMethod`, listed in `METHODS`): the weighted mean
`sum_t w_t theta_t / sum_t w_t` of whole checkpoints.

No base is needed and no statistics: the rule is element-wise, so any chunking gives the same
bytes. It follows mergekit's `linear_merge` in float32 (weights rounded to float32, a zero
accumulator updated once per input in input order, one division by the float32 sum of the
weights when normalizing) with one difference: mergekit accumulates with `addcmul_`, a fused
multiply-add on some CPUs, which would make CPU and GPU bytes differ; here each product is
rounded before the add, so results agree with mergekit within a float32 rounding per term.
A zero weight sum is refused by the parameter check (mergekit would divide by it).
mergekit sums the weights with `torch.sum`, which adds in input order for up to 4 inputs;
beyond that its order, and so the last bit of the divisor, may differ from ours.

On the CPU the map pass is the geometric methods' fused blend (`kernels/blend_numba`, the
models with no base, the sum started from +0.0), op for op this rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ram_dist.errors import RamDistError
from ram_dist.methods.generalized_task_arithmetic.combine import ordered_sum
from ram_dist.methods.parameters import NORMALIZE, WEIGHT, Parameter, variant
from ram_dist.methods.protocol import MergekitRule, NoStatistics, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork


def merge_chunk(
    inputs: Sequence[torch.Tensor], weights: Sequence[float], *, normalize: bool = True
) -> torch.Tensor:
    """Merged float32 values of one chunk of every input model, in the user's order."""
    import torch

    if not inputs:
        raise ValueError("linear merge needs at least one input")
    if len(inputs) != len(weights):
        raise ValueError(f"{len(inputs)} inputs but {len(weights)} weights")
    device = inputs[0].device
    w = torch.tensor(list(weights), dtype=torch.float32, device=device)
    result = torch.zeros(inputs[0].shape, dtype=torch.float32, device=device)
    for t, x in enumerate(inputs):
        result = result + x.to(torch.float32) * w[t]  # two roundings: no fused multiply-add
    if normalize:
        result.div_(ordered_sum(list(w)))
    return result


def float32_weights(weights: Sequence[float]) -> tuple[list[float], float]:
    """The weights rounded to float32 and their float32 sum `((0 + w_0) + w_1) + ...`
    (`ordered_sum`'s), as the eager rule has them, without torch."""
    import numpy as np

    w = [np.float32(x) for x in weights]
    total = np.float32(0.0)
    for x in w:
        total = np.float32(total + x)
    return [float(x) for x in w], float(total)


@dataclass(frozen=True)
class LinearMethod(MergekitRule, NoStatistics):
    """mergekit's `linear`: the weighted mean of the task models (the base is not averaged)."""

    name: str = "linear"
    label: str = "Linear (weighted average)"
    summary: str = "a weighted average of the models (no base)"
    reference: str = "Wortsman et al. 2022 (model soups)"
    needs_base: bool = False
    reads_stored: bool = True
    """The blend kernel reads quantized inputs as stored."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (WEIGHT, variant(NORMALIZE, True))

    def check(self, params: TensorParams, where: str) -> None:
        """What the parameters' own checks cannot see: a weight sum to normalize by."""
        if params["normalize"] and sum(params["weight"]) == 0:
            raise RamDistError(f"{where}: the weights sum to 0; linear cannot normalize by it")

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        params = work.params
        weights = [float(w) for w in params["weight"]]
        return merge_chunk(tasks, weights, normalize=bool(params["normalize"]))

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk, whatever the parameters."""
        return True

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype by the blend kernel (the models, no
        base, from a zero sum), written into `out`; False where numba is missing."""
        from ram_dist import kernels

        kernel = kernels.numba_module("blend_numba")
        if kernel is None:
            return False
        params = work.params
        weights, total = float32_weights([float(w) for w in params["weight"]])
        base, *tasks = inputs
        kernel.blend(
            base, tasks, out, mode=kernel.MODELS, factors=weights,
            divisor=total if params["normalize"] else None, from_zero=True,
            bf16_nan=work.bf16_nan,
        )  # fmt: skip
        return True


#: `linear`, as `ram_dist.methods.METHODS` lists it.
METHODS = (LinearMethod(),)
