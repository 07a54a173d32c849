"""TALL masks (Wang et al. 2024, "Localizing Task Information for Improved Model Merging and
Compression", arXiv:2405.07813) as mergekitty's `consensus_ta` and `consensus_ties` apply
them: an element of the merged task vector is kept only where it matters to at least `k`
tasks.

The rule followed (allura-org/mergekitty: `mergekitty/merge_methods/generalized_task_arithmetic.py`,
`GTATask.execute`; `mergekitty/sparsify.py`, `get_tall_mask`; names and defaults in
`mergekitty/merge_methods/registry.py`), per tensor, in float32:

1. `mixed`: the member's combine step (`combine.mix`) without lambda: task arithmetic's for
   `consensus_ta` (nothing sparsified, whatever the density), TIES's for `consensus_ties`
   (magnitude top-k per task and sign election), divided by the weights when `normalize`.
2. Per task, its TALL mask `abs(delta_t) > lambda_t * abs(mixed - delta_t)`: strict, with
   `lambda_t` rounded to float32 and `delta_t` the task's own vector before sparsification
   (with `rescale`, mergekitty scales it in place by the L1 factor before it masks it, so
   the mask sees `delta_t * factor_t`).
3. `mixed * float32(count >= k)`, `count` the tasks whose mask holds (an element dropped where
   `mixed` is negative is -0.0, as the product makes it), then `base + mixed`. `lambda` only
   sets the masks' threshold: it does not scale `mixed`.

mergekitty reads `k` of the first task only; ram-dist takes it per task as mergekitty
declares it and refuses different values (`family.TaskArithmeticFamily.check`).

Every step is element-wise once the TIES cut is known (its reduce rounds), so the bytes do
not depend on how units cut a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def mask(delta: torch.Tensor, mixed: torch.Tensor, lambda_: float) -> torch.Tensor:
    """bool: where `delta` (one task's float32 vector) matters to its task."""
    import torch

    threshold = torch.tensor(lambda_, dtype=torch.float32, device=delta.device)
    return delta.abs() > threshold * (mixed - delta).abs()


def consensus(
    deltas: Sequence[torch.Tensor], mixed: torch.Tensor, lambdas: Sequence[float], k: int
) -> torch.Tensor:
    """`mixed` kept where at least `k` tasks' TALL masks hold, zero (times `mixed`) elsewhere."""
    import torch

    count = torch.zeros(mixed.shape, dtype=torch.int64, device=mixed.device)
    for delta, lambda_ in zip(deltas, lambdas, strict=True):
        count += mask(delta, mixed, lambda_)
    return mixed * (count >= k).to(torch.float32)
