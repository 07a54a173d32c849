"""mergekit's `multislerp`: barycentric interpolation of any number of task vectors on the
hypersphere (Goddard's multi-slerp).

mergekit 0.1.5 (`merge_methods/multislerp.py`), per tensor in float32, with `x_i` the task
vectors (the models minus the base) and `w_i` the weights (divided by their sum with
`normalize_weights`, the default): unit vectors `u_i = x_i / (|x_i| + eps)`; their weighted
mean `m = sum_i w_i u_i`, normalized (a norm below `eps` falls back to the linear blend
`w_1 x_1 + w_2 x_2` for two models, and is an error for more, except where every task
vector is zero: no task changed the tensor, which stays the base, where mergekit refuses
it); the tangent vectors
`u_i - (u_i . m) m` averaged with the weights into `v`; the exponential map back to the
sphere, `m cos|v| + v sin|v| / |v|` (with `|v| + eps`), scaled by `sum_i w_i |x_i|`; the
base added back. One model gives that model as it is.

Each of those vectors lies in the span of the `x_i`, and every norm and dot product above is
a quadratic form of their Gram matrix. So the method takes the Gram matrix in one reduce
round (exact sums, `span`), runs mergekit's steps on coefficient vectors in float64 with
`math` once per tensor, and the map pass blends `sum_i r_i x_i + base` in float32 with the
final coefficients `r_i`, each rounded to float32 once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.methods.geometric.span import Gram, SpanMethod, dot, f32, norm
from ram_dist.methods.parameters import WEIGHT, Parameter
from ram_dist.methods.protocol import TensorParams

if TYPE_CHECKING:
    pass


def _at_least_zero(name: str):  # noqa: ANN202
    def check(value: Any, where: str) -> None:
        if float(value) < 0:
            raise RamDistError(f"{where}: parameter {name} must be >= 0, got {float(value)}")

    return check


NORMALIZE_WEIGHTS = Parameter(
    "normalize_weights", True, "multislerp: divide the weights by their sum", kind=bool,
    cli_flag="--normalize-weights",
)  # fmt: skip
EPS = Parameter(
    "eps", 1e-8, "multislerp: added to the norms it divides by (mergekit's eps)",
    check=_at_least_zero("eps"),
)  # fmt: skip


def weights(raw: list[float], normalize: bool) -> list[float]:
    """The weights as mergekit uses them: float32, divided by their float32 sum."""
    w = [f32(x) for x in raw]
    if not normalize:
        return w
    total = 0.0
    for x in w:
        total = f32(total + x)
    return [f32(x / total) for x in w]


def coefficients(g: Gram, raw_weights: list[float], normalize: bool, eps: float) -> dict[str, Any]:
    """The float32 coefficients `r_i` of the merged task vector `sum_i r_i x_i`."""
    n = len(raw_weights)
    w = weights(raw_weights, normalize)
    if all(g[i][i] == 0 for i in range(n)):  # no task changed the tensor: the base
        return {"factors": [0.0] * n, "unchanged": True}
    norms = [math.sqrt(max(g[i][i], 0.0)) for i in range(n)]
    unit = [1.0 / (norms[i] + eps) for i in range(n)]  # u_i = unit[i] * x_i
    mean = [w[i] * unit[i] for i in range(n)]
    mean_norm = norm(g, mean)
    if mean_norm < eps:
        if n == 2:
            return {"factors": [w[0], w[1]], "linear": True}
        raise RamDistError(
            "the weighted sum of the task vectors' directions is zero (antipodal task vectors "
            "whose weights balance out); multislerp cannot interpolate it: change the weights"
        )
    mean = [c / mean_norm for c in mean]
    # tangent_i = u_i - (u_i . mean) mean; v = sum_i w_i tangent_i
    dots = [unit[i] * dot(g, _e(i, n), mean) for i in range(n)]
    shift = math.fsum(w[i] * dots[i] for i in range(n))
    tangent = [w[j] * unit[j] - shift * mean[j] for j in range(n)]
    tangent_norm = norm(g, tangent) + eps
    scale = math.fsum(norms[i] * w[i] for i in range(n))
    cos, sinc = math.cos(tangent_norm), math.sin(tangent_norm) / tangent_norm
    return {"factors": [f32(scale * (mean[j] * cos + tangent[j] * sinc)) for j in range(n)]}


def _e(i: int, n: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(n)]


@dataclass(frozen=True)
class Multislerp(SpanMethod):
    """multislerp of the task vectors, by its coefficients in their span."""

    name: str = "multislerp"
    label: str = "Multi-SLERP (barycentric interpolation on the hypersphere)"
    summary: str = (
        "Multi-SLERP: weighted spherical mean of any number of task vectors, added to the base"
    )
    reference: str = "Goddard, goddard.blog/posts/multislerp-wow-what-a-cool-idea"
    adds_base: bool = True
    rounds_note: str = "multislerp of one model has no round: the model is the result"
    task_counts: tuple[int, int | None] = (1, None)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (replace(WEIGHT, default=None), NORMALIZE_WEIGHTS, EPS)

    def check(self, params: TensorParams, where: str) -> None:
        if params["normalize_weights"] and len(params["weight"]) > 1:
            total = 0.0
            for x in params["weight"]:
                total = f32(total + f32(x))
            if total == 0:
                raise RamDistError(
                    f"{where}: parameter weight: the weights sum to 0; multislerp cannot "
                    "normalize by it (set normalize_weights: false, or other weights)"
                )

    def passthrough(self, n_tasks: int) -> int | None:
        return 0 if n_tasks == 1 else None

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        raw = [float(w) for w in params["weight"]]
        try:
            return coefficients(g, raw, bool(params["normalize_weights"]), float(params["eps"]))
        except RamDistError as e:
            raise RamDistError(f"{where}: {e}") from None


#: `multislerp`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Multislerp(),)
