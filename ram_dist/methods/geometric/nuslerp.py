"""mergekit's `nuslerp`: slerp of two task vectors (the two models minus the base), with the
interpolation factor from the models' weights, `t = w_2 / (w_1 + w_2)` (0.5 when the weights
sum to less than 1e-6 in magnitude), over the whole tensor (`nuslerp_flatten`, the default),
each row or each column.

mergekit 0.1.5 (`merge_methods/nuslerp.py`), per vector `v_0`, `v_1` in float32: unit vectors
`v / max(|v|, 1e-7)`, `cos` their dot clamped to [-1, 1]; colinear where
`1 - cos**2 <= 1e-16`, giving `(1 - t) v_0 + t v_1`; else `theta = acos(cos)` and
`(sin((1 - t) theta) v_0 + sin(t theta) v_1) / sin(theta)`; then the base is added back.
Which vectors: with `nuslerp_flatten` (default true) the whole tensor; without it, the
vectors along the last dimension (each row of a matrix) when `nuslerp_row_wise` is false, or
along the first dimension (each column of a matrix) when it is true.

Here the whole-tensor variant takes its two norms and dot as exact sums in one reduce round
(`span`). The row variant computes them per row inside each chunk, which holds whole rows
(`whole_rows`), with exact sums per row and each row's factors with `math`, on the CPU. The
column variant takes each column's three exact sums in one reduce round (`columns`, a
compact exact accumulator), its factors per column on the driver, and blends chunks of whole
rows. Factors are `sin((1 - t) theta)`, `sin(t theta)` and `sin(theta)` (colinear: `1 - t`,
`t` and 1), each rounded to float32 once; the blend is mergekit's, op by op:
`(f_0 * v_0 + f_1 * v_1) / f_d + base`. The colinear test is mergekit's, evaluated as
mergekit evaluates it (in float32, on the exact cosine rounded to float32), so colinear
task vectors give mergekit's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ram_dist.methods.geometric import columns
from ram_dist.methods.geometric.span import (
    Gram,
    SpanMethod,
    blend,
    f32,
    float32,
    gram,
    row_grams,
    task_vectors,
)
from ram_dist.methods.parameters import WEIGHT, Parameter
from ram_dist.methods.protocol import State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

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
    summary: str = (
        "NuSLERP: slerp of two task vectors, factor from their weights; whole tensors, "
        "rows or columns"
    )
    reference: str = "mergekit's own (Goddard et al. 2024, MergeKit)"
    adds_base: bool = True
    rounds_note: str = (
        "nuslerp row by row has no round: each chunk holds whole rows and sums them itself"
    )
    task_counts: tuple[int, int | None] = (2, 2)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (replace(WEIGHT, default=None), FLATTEN, ROW_WISE)

    def whole_rows(self, params: TensorParams) -> bool:
        return variant(params) != "whole"

    def needs_round(self, params: TensorParams) -> bool:
        return variant(params) != "rows"

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        t = interpolation_factor([float(w) for w in params["weight"]])
        f0, f1, divisor = factors(g[0][0], g[1][1], g[0][1], t)
        return {"factors": [f0, f1], "divisor": divisor, "linear": colinear_cos(g)}

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The whole tensor's Gram matrix, or (columns) each column's sums: `|v_0|**2`,
        `|v_1|**2` and `v_0 . v_1`, int64[3, columns, SLOTS]."""
        chunk, params = work.chunk, work.params
        if variant(params) != "columns":
            return super().chunk_statistics(work, base, tasks)
        import torch

        v0, v1 = task_vectors(base, tasks)
        n = column_count(chunk.shape)
        pairs = ((v0, v0), (v1, v1), (v0, v1))
        return {chunk.tensor: torch.stack([columns.column_sums(x, y, n) for x, y in pairs])}

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The whole tensor's Gram matrix, or each column's sums, by the fused kernels."""
        chunk, params = work.chunk, work.params
        if variant(params) != "columns":
            return super().fused_statistics(work, inputs)
        base, *tasks = inputs  # as stored: the kernel decodes a quantized one as it loads
        pairs = [(0, 0), (1, 1), (0, 1)]
        stats = columns.fused_column_sums(base, tasks, pairs, column_count(chunk.shape))
        return None if stats is None else ({chunk.tensor: stats}, None)

    def finalize(self, end: RoundTotals) -> State:
        totals, params, state = end.totals, end.params, end.state
        for name, info in state["tensors"].items():
            if name not in totals:
                continue
            p = params[name]
            if variant(p) != "columns":
                info.update(self.coefficients(gram(totals[name], 2), p, f"tensor {name!r}"))
                continue
            t = interpolation_factor([float(w) for w in p["weight"]])
            s00, s11, s01 = (columns.values(stat) for stat in totals[name])
            found = [factors(a, b, c, t) for a, b, c in zip(s00, s11, s01, strict=True)]
            info["columns"] = [[f[k] for f in found] for k in range(3)]
        return state

    def merge_rows(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        """Whole rows of the tensor: each row's own factors (computed here, on the CPU's
        Python, from exact sums per row), or each column's (from the state)."""
        chunk, params, state = work.chunk, work.params, work.state
        import torch

        if variant(params) == "columns":
            n = column_count(chunk.shape)
            found = state["tensors"][chunk.tensor]["columns"]
            shape = (1, n)
        else:
            n = chunk.shape[-1] if chunk.shape else 1
            vectors = [v.reshape(-1) for v in task_vectors(base, tasks)]
            t = interpolation_factor([float(w) for w in params["weight"]])
            per_row = [factors(g[0][0], g[1][1], g[0][1], t) for g in row_grams(vectors, n)]
            found = [[f[k] for f in per_row] for k in range(3)]
            shape = (-1, 1)
        b = float32(base).reshape(-1, n)
        vectors = [v.reshape(-1, n) for v in task_vectors(base, tasks)]
        f0, f1, divisor = (
            torch.tensor(f, dtype=torch.float32, device=b.device).reshape(shape) for f in found
        )
        return blend(vectors, [f0, f1], divisor=divisor, base=b).reshape(base.shape)


def variant(params: TensorParams) -> str:
    """`whole` (flattened), `rows` (vectors along the last dimension) or `columns` (along
    the first)."""
    if params["nuslerp_flatten"]:
        return "whole"
    return "columns" if params["nuslerp_row_wise"] else "rows"


def column_count(shape: tuple[int, ...]) -> int:
    """Vectors along the first dimension: one per element of a row (a 1-D tensor: one)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


#: `nuslerp`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Nuslerp(),)
