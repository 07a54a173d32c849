"""mergekit's generalized task arithmetic family: `task_arithmetic`, `ties`, `dare_linear`
and `dare_ties`, and mergekitty's `consensus_ta` and `consensus_ties`, one method class
configured six ways (`family.TaskArithmeticFamily`);
beside it the sparsifiers with rounds of their own, `breadcrumbs` and `breadcrumbs_ties`
(`breadcrumbs.Breadcrumbs`), `della` and `della_linear` (`della.Della`), all listed in
`METHODS`. Each member takes the task vectors
`delta_t = theta_t - theta_B`, sparsifies them or not, and combines them with the weights.

The rules, one module each:

* `combine`: the weighted combine step every member ends with, with optional sign consensus
  and normalization; `task_arithmetic` is this step alone.
* `topk`: TIES's exact magnitude cut over a whole tensor, from histograms summed over chunks.
* `ties`: TIES's reduce rounds over the cut: which tasks are cut, each round's statistics
  per chunk and what the driver finds from their sums, the kept L1 norm.
* `dare`: DARE's random drop and the L1 rescale rule, with exact integer L1 sums.
* `rng`: the counter-based random numbers behind DARE's masks.
* `breadcrumbs`: Model Breadcrumbs' two magnitude cuts per task (outliers and the smallest),
  each one of `topk`'s exact cuts.
* `della`: DELLA's keep probabilities from magnitude ranks within rows, drawn with `rng`.
* `tall`: the TALL masks of the consensus members: keep the merged task vector where it
  matters to at least `k` tasks.
"""

from __future__ import annotations

from ram_dist.methods.generalized_task_arithmetic import breadcrumbs, della, family
from ram_dist.methods.generalized_task_arithmetic.family import TaskArithmeticFamily

METHODS = (*family.METHODS, *breadcrumbs.METHODS, *della.METHODS)

__all__ = ["METHODS", "TaskArithmeticFamily"]
