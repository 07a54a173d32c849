"""An independent reference of mergekitty's `consensus_ta` and `consensus_ties` (TALL masks,
Wang et al. 2024), written from the rule on whole tensors, plainly. It never imports
`ram_dist`.

The rule (allura-org/mergekitty, `mergekitty/merge_methods/generalized_task_arithmetic.py`
and `mergekitty/sparsify.py`), per tensor, in float32:

* `delta_t`: the task vector at the task's precision (`reference.task_vector`).
* consensus_ties only: each `delta_t` with density < 1 keeps its `max(1, int(density * n))`
  largest magnitudes (ties at the cut: the lowest flat index first, `sparse_reference`);
  with `rescale`, `delta_t` itself is first multiplied by `float32(L1(delta_t) /
  L1(kept))` (exact sums, each rounded once to float32), skipped where either is below
  float32(1e-8), and the kept part is that scaled vector times the mask.
* `mixed`: `w_t * kept_t` summed in task order from +0; consensus_ties elects the sign
  (`+1` where the sum is >= 0) and sums the agreeing terms and their weights (a zero divisor
  becomes 1), consensus_ta sums them all (a divisor of |.| < 1e-8 becomes 1); divided when
  `normalize` (default: consensus_ties only). No lambda scaling.
* Task t matters at an element where `|delta_t| > float32(lambda_t) * |mixed - delta_t|`.
* `mixed * float32(count >= k)`; the result `base + mixed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from reference import task_vector
from sparse_reference import _l1, ties_mask

METHODS = ("consensus_ta", "consensus_ties")


def _sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(terms[0])
    for x in terms:
        total = total + x
    return total


def consensus_merge(
    method: str,
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    weights: Sequence[float],
    densities: Sequence[float] | None = None,
    normalize: bool | None = None,
    rescale: bool = False,
    k: int = 1,
    lambdas: Sequence[float] | None = None,
) -> torch.Tensor:
    """One tensor merged by `method` (mergekitty's defaults where None), float32."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    ties = method == "consensus_ties"
    n = len(tasks)
    densities = [1.0] * n if densities is None else list(densities)
    lambdas = [1.0] * n if lambdas is None else list(lambdas)
    normalize = ties if normalize is None else normalize
    deltas, kept = [], []
    for t, task in enumerate(tasks):
        delta = task_vector(base, task)
        if not ties or densities[t] >= 1:
            deltas.append(delta)
            kept.append(delta)
            continue
        mask = ties_mask(delta, densities[t]).reshape(delta.shape).to(torch.float32)
        if rescale:
            before, after = _l1(delta), _l1(delta * mask)
            eps = np.float32(1e-8)
            if before >= eps and after >= eps:
                delta = delta * torch.tensor(float(np.float32(before / after)))
        deltas.append(delta)
        kept.append(delta * mask)
    w = [torch.tensor(x, dtype=torch.float32) for x in weights]
    weighted = [d * wt for d, wt in zip(kept, w, strict=True)]
    if ties:
        sign = torch.where(_sum(weighted) >= 0, 1.0, -1.0)
        agree = [x.sign() == sign for x in weighted]
        mixed = _sum([x * a for x, a in zip(weighted, agree, strict=True)])
        divisor = _sum([wt * a for wt, a in zip(w, agree, strict=True)])
        divisor = torch.where(divisor == 0, 1.0, divisor)
    else:
        mixed = _sum(weighted)
        divisor = _sum(w)
        if divisor.abs() < 1e-8:
            divisor = torch.ones_like(divisor)
    if normalize:
        mixed = mixed / divisor
    count = torch.zeros(mixed.shape, dtype=torch.int64)
    for d, lam in zip(deltas, lambdas, strict=True):
        count += (d.abs() > torch.tensor(lam, dtype=torch.float32) * (mixed - d).abs()).long()
    return base.float() + mixed * (count >= k).to(torch.float32)
