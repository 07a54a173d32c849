"""mergekit's geometric methods: `slerp`, `nuslerp`, `multislerp` and `karcher` (`METHODS`).

Each merged tensor is a linear combination of its inputs (or their task vectors) whose
coefficients depend only on their norms and dot products: one reduce round of exact sums
(`span`), the angles and coefficients once per tensor on the driver in float64, and an
element-wise float32 blend in the map pass. `nuslerp` row by row computes its sums per row
inside each chunk, which holds whole rows.
"""

from __future__ import annotations

from ram_dist.methods.geometric import karcher, multislerp, nuslerp, slerp

#: The family's members, with mergekit's names, as `ram_dist.methods.METHODS` lists them.
METHODS = (*slerp.METHODS, *nuslerp.METHODS, *multislerp.METHODS, *karcher.METHODS)
