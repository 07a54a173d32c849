"""mergekit's `slerp`: spherical linear interpolation between the base and one other model,
per tensor, `t = 0` giving the base and `t = 1` the other model.

mergekit 0.1.5 (`merge_methods/slerp.py`), per tensor in float32: `a` the base, `b` the
model, each flattened; norms `|a|`, `|b|` (a norm `<= 1e-8` taken as 1); `dot = (a / |a|) .
(b / |b|)` clamped to [-1, 1]; where `|dot| > 0.9995` the linear blend `(1 - t) a + t b`,
else `theta = acos(dot)` and `sin((1 - t) theta) / sin(theta) * a + sin(t theta) /
sin(theta) * b`.

Here the norms and the dot are exact sums (`span`), `dot = S_ab / (|a| |b|)` and the two
coefficients are computed once per tensor in float64 with `math` from `t` rounded to float32
(mergekit's value of it), each rounded to float32 once; the blend is mergekit's
`c_a * a + c_b * b`, op by op. On the linear branch the coefficients are mergekit's own
(`1 - t` in float32, and `t`), so the bytes are mergekit's; on the spherical branch they
differ from mergekit's float32 ones by rounding only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ram_dist.methods.geometric.span import Gram, SpanMethod, f32
from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import TensorParams

#: mergekit's threshold of `|dot|` above which slerp blends linearly, and its zero norm.
DOT_THRESHOLD = 0.9995
EPS = 1e-8

T = Parameter(
    "t", None, "slerp's interpolation factor: 0 gives the base, 1 the other model",
    cli_flag="--t",
)  # fmt: skip


def coefficients(g: Gram, t: float) -> dict[str, Any]:
    """slerp's two float32 coefficients from the Gram matrix of (base, model)."""
    t32 = f32(t)
    norm_a, norm_b = math.sqrt(g[0][0]), math.sqrt(g[1][1])
    norm_a = norm_a if norm_a > EPS else 1.0
    norm_b = norm_b if norm_b > EPS else 1.0
    cos = min(max(g[0][1] / (norm_a * norm_b), -1.0), 1.0)
    if abs(cos) > DOT_THRESHOLD or cos != cos:
        return {"factors": [f32(1.0 - t32), t32], "linear": True}
    theta = math.acos(cos)
    s = math.sin(theta)
    return {"factors": [f32(math.sin((1.0 - t32) * theta) / s), f32(math.sin(t32 * theta) / s)]}


@dataclass(frozen=True)
class Slerp(SpanMethod):
    """slerp between the base and one model; coefficients from their exact Gram matrix."""

    name: str = "slerp"
    label: str = "SLERP (spherical linear interpolation)"
    summary: str = "SLERP: spherical interpolation between the base and one model, factor t"
    reference: str = "Shoemake 1985, Animating rotation with quaternion curves"
    blends: str = "pair"
    task_counts: tuple[int, int | None] = (1, 1)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (T,)

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        return coefficients(g, float(params["t"]))


#: `slerp`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Slerp(),)
