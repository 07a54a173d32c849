"""Linear merge: the weighted mean `sum_t w_t theta_t / sum_t w_t` of whole checkpoints.

No base is needed and no statistics: the rule is element-wise, so any chunking gives the same
bytes. It follows mergekit's `linear_merge` operation for operation in float32: weights
rounded to float32, a zero accumulator updated with `addcmul_` once per input in input order
(a fused multiply-add on CPU, the same kernel for a chunk as for a whole tensor), then one
division by the float32 sum of the weights when normalizing. A zero weight sum is not
special-cased (mergekit divides by it too; the engine's parameter check should refuse it).
mergekit sums the weights with `torch.sum`, which adds in input order for up to 4 inputs;
beyond that its order, and so the last bit of the divisor, may differ from ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ram_dist.methods.task_arithmetic import ordered_sum


def merge_chunk(
    inputs: Sequence[torch.Tensor], weights: Sequence[float], *, normalize: bool = True
) -> torch.Tensor:
    """Merged float32 values of one chunk of every input model, in the user's order."""
    if not inputs:
        raise ValueError("linear merge needs at least one input")
    if len(inputs) != len(weights):
        raise ValueError(f"{len(inputs)} inputs but {len(weights)} weights")
    device = inputs[0].device
    w = torch.tensor(list(weights), dtype=torch.float32, device=device)
    result = torch.zeros(inputs[0].shape, dtype=torch.float32, device=device)
    for t, x in enumerate(inputs):
        result.addcmul_(x.to(torch.float32), w[t])
    if normalize:
        result.div_(ordered_sum(list(w)))
    return result
