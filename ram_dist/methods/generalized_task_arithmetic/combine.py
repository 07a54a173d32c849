"""The weighted combine step every member of the family ends with; `task_arithmetic` is this
step alone (`merge_chunk`).

`combine` follows mergekit's generalized task arithmetic tail
(`GeneralizedTaskArithmeticMerge.merge_group`) operation for operation, in float32:
weights rounded to float32; `d_t = delta_t * w_t`; optional TIES sign election
(`s = +1 if sum_t d_t >= 0 else -1`, keep `d_t` whose sign equals s, zeros never match);
`mixed = sum kept d_t`; divisor `sum_t w_t * kept_t` (consensus, 0 -> 1) or `sum_t w_t`
(|.| < 1e-8 -> 1); `mixed / divisor` when normalizing; `mixed * lambda` when lambda != 1;
`base + mixed`.

Every operation is element-wise, so the result does not depend on chunking or device. Sums
over tasks run in task order from a +0 accumulator. mergekit sums with
`torch.sum(dim=0)`, whose CPU kernel adds rows in that same order for N <= 4 tasks, so
results are byte-identical there; for N >= 5 its order depends on the element's position
in the tensor, the CPU's vector width and the thread split (4-way interleaved partial sums),
and results differ from ours by float32 rounding of the sum only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ram_dist.methods.task_vectors import task_vectors

if TYPE_CHECKING:
    import torch


#: mergekit's threshold below which a plain weight sum is treated as zero.
WEIGHT_SUM_EPS = 1e-8


def ordered_sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """`((0 + x_0) + x_1) + ...`: the order mergekit's task-axis sum uses for N <= 4."""
    import torch

    total = torch.zeros_like(terms[0])
    for term in terms:
        total = total + term
    return total


def mix(
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    consensus: bool,
    normalize: bool,
    lambda_: float,
) -> torch.Tensor:
    """The merged float32 task vector `mixed` from (sparsified) float32 task vectors: what
    `combine` adds to the base, and what the TALL masks (`tall`) compare each task with."""
    import torch

    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} task vectors but {len(weights)} weights")
    w = torch.tensor(list(weights), dtype=torch.float32, device=deltas[0].device)
    weighted = [delta * w[t] for t, delta in enumerate(deltas)]
    if consensus:
        majority = (ordered_sum(weighted) >= 0).to(torch.float32) * 2 - 1
        kept = [d.sign() == majority for d in weighted]
        mixed = ordered_sum([d * m for d, m in zip(weighted, kept, strict=True)])
        divisor = ordered_sum([w[t] * m for t, m in enumerate(kept)])
        divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    else:
        mixed = ordered_sum(weighted)
        divisor = ordered_sum(list(w))
        if divisor.abs() < WEIGHT_SUM_EPS:
            divisor = torch.ones_like(divisor)
    if normalize:
        mixed = mixed / divisor
    if lambda_ != 1:
        mixed = mixed * lambda_
    return mixed


def combine(
    base: torch.Tensor,
    deltas: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    consensus: bool,
    normalize: bool,
    lambda_: float,
) -> torch.Tensor:
    """Merged float32 values `base + mixed` from (sparsified) float32 task vectors."""
    return base + mix(deltas, weights, consensus=consensus, normalize=normalize, lambda_=lambda_)


def merge_chunk(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    normalize: bool = False,
    lambda_: float = 1.0,
) -> torch.Tensor:
    """Task arithmetic on one chunk: `base + lambda * sum_t w_t delta_t [/ sum_t w_t]`.

    Needs no statistics: the rule is element-wise. Returns float32 merged values.
    """
    b, deltas = task_vectors(base, tasks)
    return combine(b, deltas, weights, consensus=False, normalize=normalize, lambda_=lambda_)
