"""mergekit's `karcher`: the Karcher (Riemannian, Frechet) mean of the models on the unit
hypersphere, scaled back by their mean norm; no base.

mergekit 0.1.5 (`merge_methods/karcher.py`), per tensor in float32, with `x_i` the N models
and weights `a_i = 1 / N`: unit vectors `u_i = x_i / |x_i|`; only models with `|x_i| > tol`
take part (none: zeros), their weights renormalized to sum to 1; the start is the
normalized weighted mean of their `u_i` (the first unit vector when that mean's norm is
below `tol`); then at most `max_iter` steps: the tangent
`sum_i a_i theta_i / sin(theta_i) (u_i - cos(theta_i) m)` over the models with
`theta_i = acos(u_i . m) >= tol`, a stop when its norm is below `tol`, else
`m <- cos|v| m + sin|v| v / |v|`, normalized. The result is `(sum_i a_i |x_i|) m`.

Every iterate lies in the span of the `x_i`, and every norm and dot product is a quadratic
form of their Gram matrix. So the iteration runs on coefficient vectors, in float64 with
`math`, once per tensor on the driver, from the exact Gram matrix (one reduce round, `span`);
the map pass blends `sum_i r_i x_i` in float32 with the final coefficients, each rounded to
float32 once. One model gives that model as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.methods.geometric.span import Gram, SpanMethod, dot, f32, norm
from ram_dist.methods.parameters import Parameter
from ram_dist.methods.protocol import TensorParams

if TYPE_CHECKING:
    pass


def _max_iter(value: Any, where: str) -> None:
    if value < 0:
        raise RamDistError(f"{where}: parameter max_iter must be >= 0, got {value}")


def _tol(value: Any, where: str) -> None:
    if float(value) < 0:
        raise RamDistError(f"{where}: parameter tol must be >= 0, got {float(value)}")


MAX_ITER = Parameter(
    "max_iter", 10, "karcher: most iterations of the Karcher mean", kind=int,
    cli_flag="--max-iter", check=_max_iter,
)  # fmt: skip
TOL = Parameter(
    "tol", 1e-5, "karcher: convergence tolerance (and the smallest norm taken)",
    cli_flag="--tol", check=_tol,
)  # fmt: skip


def coefficients(g: Gram, max_iter: int, tol: float) -> dict[str, Any]:
    """The float32 coefficients `r_i` of the Karcher mean `sum_i r_i x_i`, and the steps
    taken."""
    n = len(g)
    alphas = [1.0 / n] * n
    norms = [math.sqrt(max(g[i][i], 0.0)) for i in range(n)]
    # u_i = x_i / |x_i|: coefficient vector units[i]
    units = [[(1.0 / norms[i] if j == i and norms[i] != 0 else 0.0) for j in range(n)]
             for i in range(n)]  # fmt: skip
    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return {"zeros": True, "steps": 0}
    alpha_sum = math.fsum(alphas[i] for i in valid)
    weights = {i: alphas[i] / alpha_sum for i in valid}
    mean = [math.fsum(weights[i] * units[i][j] for i in valid) for j in range(n)]
    mean_norm = norm(g, mean)
    mean = list(units[valid[0]]) if mean_norm < tol else [c / mean_norm for c in mean]
    steps = 0
    for _ in range(max_iter):
        tangent = [0.0] * n
        for i in valid:
            cos = min(max(dot(g, mean, units[i]), -1.0), 1.0)
            theta = math.acos(cos)
            if theta < tol:
                continue
            scale = weights[i] * (theta / math.sin(theta))
            tangent = [tangent[j] + scale * (units[i][j] - cos * mean[j]) for j in range(n)]
        tangent_norm = norm(g, tangent)
        if tangent_norm < tol:
            break
        steps += 1
        c, s = math.cos(tangent_norm), math.sin(tangent_norm) / tangent_norm
        mean = [c * mean[j] + s * tangent[j] for j in range(n)]
        unit_norm = norm(g, mean)
        if unit_norm > tol:
            mean = [m / unit_norm for m in mean]
    scale = math.fsum(alphas[i] * norms[i] for i in range(n))
    return {"factors": [f32(scale * m) for m in mean], "steps": steps}


@dataclass(frozen=True)
class Karcher(SpanMethod):
    """The Karcher mean of the models, by its coefficients in their span."""

    name: str = "karcher"
    label: str = "Karcher mean (Riemannian barycenter on the hypersphere)"
    summary: str = "Karcher mean of the models on the sphere, scaled by their mean norm (no base)"
    reference: str = (
        "Functionality-Oriented LLM Merging on the Fisher-Rao Manifold, arXiv:2603.04972"
    )
    needs_base: bool = False
    blends: str = "models"
    rounds_note: str = "karcher of one model has no round: the model is the result"
    task_counts: tuple[int, int | None] = (1, None)

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        return (MAX_ITER, TOL)

    def passthrough(self, n_tasks: int) -> int | None:
        return 0 if n_tasks == 1 else None

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        return coefficients(g, int(params["max_iter"]), float(params["tol"]))

    def report(self, state: dict[str, Any]) -> dict[str, Any]:
        steps = [i.get("steps", 0) for i in state.get("tensors", {}).values()]
        return {"karcher": {"most_iterations_of_a_tensor": max(steps, default=0)}}


#: `karcher`, as `ram_dist.methods.METHODS` lists it.
METHODS = (Karcher(),)
