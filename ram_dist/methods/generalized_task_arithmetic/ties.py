"""TIES: magnitude sparsification per task, sign election, disjoint mean.

Per tensor and task, keep the k = max(1, int(density * numel)) largest |delta| (ties at the
cut: lowest flat index first), then `combine.combine` with the sign election and
(default) normalization by the kept weights. mergekit's special cases are kept: density >= 1
leaves the delta untouched, density <= 0 gives zeros.

The engine runs it as `family.TaskArithmeticFamily` ("ties"): the cut's reduce rounds and
its per-element keep rule are `topk.py`'s. With `rescale` (mergekit's L1 rule, off by default
for TIES) round 0 also yields the L1 statistic of delta (`dare.l1_statistic`) and round 2 that
of the keys above the cut; the kept keys equal to the cut all have the same value, so
`kept_l1` adds them exactly on the driver.

Byte identity with mergekit holds unless the cut splits a group of equal non-zero
magnitudes (mergekit's unstable argsort picks arbitrarily among them; for zeros the choice
changes no byte, as a kept or dropped zero delta is the same zero) and, as for every
combine, for N <= 4 tasks (see `combine`). With `rescale` the L1 factor may differ
by an ulp (see `dare`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ram_dist.methods.generalized_task_arithmetic.dare import l1_statistic
from ram_dist.methods.generalized_task_arithmetic.topk import Cut

if TYPE_CHECKING:
    import torch


def needs_cut(density: float, numel: int) -> bool:
    """Whether a task's tensor is sparsified by magnitude at all (0 < density < 1)."""
    return 0 < density < 1 and numel > 0


def kept_l1(above: torch.Tensor, cut: Cut) -> torch.Tensor:
    """Driver: the L1 statistic of the kept elements, from that of the keys above the cut."""
    import torch

    value = torch.tensor([cut.threshold], dtype=torch.int32).view(torch.float32)
    return above + l1_statistic(value) * cut.need_at_threshold
