"""mergekit's `nuslerp`: slerp of two task vectors (the two models minus the base), with the
interpolation factor from the models' weights, `t = w_2 / (w_1 + w_2)` (0.5 when the weights
sum to less than 1e-6 in magnitude), over the whole tensor (`nuslerp_flatten`, the default) or
over each row.

mergekit 0.1.5 (`merge_methods/nuslerp.py`), per vector `v_0`, `v_1` in float32: unit vectors
`v / max(|v|, 1e-7)`, `cos` their dot clamped to [-1, 1]; colinear where
`1 - cos**2 <= 1e-16`, giving `(1 - t) v_0 + t v_1`; else `theta = acos(cos)` and
`(sin((1 - t) theta) v_0 + sin(t theta) v_1) / sin(theta)`; then the base is added back.
Which vectors: with `nuslerp_flatten` (default true) the whole tensor; without it, the
vectors along the last dimension (each row of a matrix) when `nuslerp_row_wise` is false, or
along the first dimension (each column of a matrix) when it is true.

Here the whole-tensor variant takes its two norms and dot as exact sums in one reduce round
(`span`); the row variant computes them per row inside each chunk, which holds whole rows
(`whole_rows`), with exact sums per row and the factors per row with `math` on the CPU.
Factors are `sin((1 - t) theta)`, `sin(t theta)` and `sin(theta)` (colinear: `1 - t`, `t`
and 1), each rounded to float32 once; the blend is mergekit's, op by op:
`(f_0 * v_0 + f_1 * v_1) / f_d + base`. The colinear test is mergekit's, evaluated as
mergekit evaluates it (in float32, on the exact cosine rounded to float32), so colinear
task vectors give mergekit's bytes. The column variant (`nuslerp_row_wise: true` with
`nuslerp_flatten: false`) needs every row of a column at once, so it is refused (`check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ram_dist.methods.geometric.span import (
    Gram,
    SpanMethod,
    blend,
    f32,
    float32,
    refuse,
    row_grams,
    task_vectors,
)
from ram_dist.methods.parameters import WEIGHT, Parameter
from ram_dist.methods.protocol import Chunk, TensorParams

if TYPE_CHECKING:
    import torch

#: mergekit's floor of a norm, and its colinearity threshold `eps**2`.
NORM_FLOOR = 1e-7
COLINEAR = 1e-8**2

FLATTEN = Parameter(
    "nuslerp_flatten", True, "nuslerp: interpolate whole tensors (false: row by row)",
    kind=bool, cli_flag="--nuslerp-flatten",
)  # fmt: skip
ROW_WISE = Parameter(
    "nuslerp_row_wise", False,
    "nuslerp without flattening: interpolate the vectors along the first dimension (columns "
    "of a matrix) instead of the last (rows)",
    kind=bool, cli_flag="--nuslerp-row-wise",
)  # fmt: skip


def interpolation_factor(weights: list[float]) -> float:
    """mergekit's `t`: the second model's share of the weights, 0.5 for a zero sum."""
    total = sum(weights)
    return 0.5 if abs(total) < 1e-6 else weights[1] / total


def colinear(cos: float) -> bool:
    """mergekit's test `1 - cos**2 <= 1e-16` as it evaluates it, in float32 on the cosine
    rounded to float32 (true exactly where that cosine is +-1)."""
    c = f32(cos)
    return cos != cos or f32(1.0 - f32(c * c)) <= f32(COLINEAR)


def colinear_cos(g: Gram) -> bool:
    """Whether the whole tensor's task vectors are colinear (the linear blend)."""
    n0 = max(math.sqrt(g[0][0]), NORM_FLOOR)
    n1 = max(math.sqrt(g[1][1]), NORM_FLOOR)
    return colinear(min(max(g[0][1] / (n0 * n1), -1.0), 1.0))


def factors(s00: float, s11: float, s01: float, t: float) -> tuple[float, float, float]:
    """The float32 factors (f_0, f_1, divisor) of one pair of vectors from their exact
    squared norms and dot product."""
    n0 = max(math.sqrt(s00), NORM_FLOOR)
    n1 = max(math.sqrt(s11), NORM_FLOOR)
    cos = min(max(s01 / (n0 * n1), -1.0), 1.0)
    if colinear(cos):
        return f32(1.0 - t), f32(t), 1.0
    theta = math.acos(cos)
    return f32(math.sin((1.0 - t) * theta)), f32(math.sin(t * theta)), f32(math.sin(theta))


@dataclass(frozen=True)
class Nuslerp(SpanMethod):
    """nuslerp of two task vectors, whole tensors or row by row."""

    name: str = "nuslerp"
    label: str = "NuSLERP (slerp of two task vectors)"
    reference: str = "mergekit (Goddard et al. 2024)"
    needs_base: bool = True
    adds_base: bool = True
    task_counts: tuple[int, int | None] = (2, 2)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (replace(WEIGHT, default=None), FLATTEN, ROW_WISE)

    def check(self, params: TensorParams, where: str) -> None:
        if not params["nuslerp_flatten"] and params["nuslerp_row_wise"]:
            refuse(
                where,
                "parameter nuslerp_row_wise: true (with nuslerp_flatten: false) interpolates "
                "each column, which needs every row at once and is not supported; use "
                "nuslerp_flatten: true (the default), or nuslerp_row_wise: false (each row)",
            )

    def whole_rows(self, params: TensorParams) -> bool:
        return not params["nuslerp_flatten"]

    def vectors(self, base: torch.Tensor, tasks: list[torch.Tensor]) -> list[torch.Tensor]:
        return task_vectors(base, tasks)

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        t = interpolation_factor([float(w) for w in params["weight"]])
        f0, f1, divisor = factors(g[0][0], g[1][1], g[0][1], t)
        return {"factors": [f0, f1], "divisor": divisor, "linear": colinear_cos(g)}

    def merge_rows(
        self, chunk: Chunk, base: torch.Tensor, tasks: list[torch.Tensor], params: TensorParams
    ) -> torch.Tensor:
        """Row by row: the chunk holds whole rows of the tensor (`chunk.shape`)."""
        import torch

        shape = chunk.shape
        row = shape[-1] if len(shape) > 0 else 1
        row = max(row, 1)
        b = float32(base).reshape(-1, row)
        vectors = [v.reshape(-1, row) for v in task_vectors(base, tasks)]
        t = interpolation_factor([float(w) for w in params["weight"]])
        found = [
            factors(g[0][0], g[1][1], g[0][1], t)
            for g in row_grams([v.reshape(-1) for v in vectors], row)
        ]
        columns = [
            torch.tensor([f[k] for f in found], dtype=torch.float32, device=b.device).reshape(-1, 1)
            for k in range(3)
        ]
        out = blend(vectors, columns[:2], divisor=columns[2], base=b)
        return out.reshape(base.shape)


#: `nuslerp`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Nuslerp(),)
