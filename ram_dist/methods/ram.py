"""RAM, RAM+ and RAM+s (Yuan et al. 2026), exactly as `shared/spec/ram.md` fixes them.

Per element: average the task vectors where two or more tasks changed the weight, keep
(times lambda_t) the update where only one task did, keep the base where none did. lambda_t
comes from whole-model overlap counts, so the reduce pass counts and the map pass merges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ram_dist.errors import RamDistError
from ram_dist.methods.registry import register


@dataclass(frozen=True, kw_only=True)
class RamParams:
    """Parameters of the RAM family, checked when the job starts."""

    r: float = 0.1
    """Strength of the RAM+ rescaling of unique updates."""
    alpha: float = 2.0
    """Cap on the overlap ratio rho in RAM+."""
    eps: float = 1e-5
    """An element counts as changed when |tau| > eps (strict), compared in the compute dtype."""

    def __post_init__(self) -> None:
        for field, value in (("r", self.r), ("alpha", self.alpha), ("eps", self.eps)):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise RamDistError(f"parameter {field} must be a number, got {value!r}")
            if math.isnan(value) or math.isinf(value):
                raise RamDistError(f"parameter {field} must be finite, got {value!r}")
        if self.eps <= 0:
            raise RamDistError(f"parameter eps must be > 0, got {self.eps}")
        if self.r < 0:
            raise RamDistError(f"parameter r must be >= 0, got {self.r}")
        if self.alpha < 0:
            raise RamDistError(f"parameter alpha must be >= 0, got {self.alpha}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input of the tensor is float64, else float32 (the spec)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _masks(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Base in the compute dtype, task vectors, strict change masks and the count c."""
    cdt = compute_dtype(base, *tasks)
    b = base.to(cdt)
    taus = [t.to(cdt) - b for t in tasks]
    masks = [tau.abs() > eps for tau in taus]
    count = torch.zeros(b.shape, dtype=torch.int64, device=b.device)
    for m in masks:
        count += m
    return b, taus, masks, count


def overlap_statistics(base: torch.Tensor, tasks: list[torch.Tensor], eps: float) -> torch.Tensor:
    """int64 [N+1, N+1]: row t < N is H[t][k] (k = 0..N, k = 0 always 0); row N counts c = k."""
    _, _, masks, count = _masks(base, tasks, eps)
    n = len(tasks)
    rows = [torch.bincount(count[m], minlength=n + 1) for m in masks]
    rows.append(torch.bincount(count.reshape(-1), minlength=n + 1))
    return torch.stack(rows).to(device="cpu", dtype=torch.int64)


def rho(unique: int, shared: int) -> float:
    """shared / unique; +inf when only shared updates exist, 0 when the task changed nothing."""
    if unique == 0:
        return math.inf if shared > 0 else 0.0
    return shared / unique


def lambda_ram(rho_t: float, r: float, alpha: float) -> float:
    return 1.0


def lambda_ram_plus(rho_t: float, r: float, alpha: float) -> float:
    return 1.0 + r * min(max(rho_t, 0.0), alpha)


def lambda_ram_plus_soft(rho_t: float, r: float, alpha: float) -> float:
    if math.isinf(rho_t):
        return 1.0 + r
    return 1.0 + r * rho_t / (1.0 + rho_t)


def to_float32(value: float) -> float:
    """Round a float64 to the nearest float32 once (lambda_t is used only in this form)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def summarize(total: torch.Tensor, params: RamParams) -> dict[str, Any]:
    """Whole-model statistics and lambda_t under every RAM variant (float64, then float32)."""
    n = total.shape[0] - 1
    by_count = [int(v) for v in total[n]]
    d = sum(by_count)
    tasks = []
    for t in range(n):
        hist = [int(v) for v in total[t, 1:]]
        unique, shared = hist[0], sum(hist[1:])
        rho_t = rho(unique, shared)
        lambdas = {
            name: to_float32(rule(rho_t, params.r, params.alpha))
            for name, rule in LAMBDA_RULES.items()
        }
        tasks.append(
            {
                "changed": unique + shared,
                "density": (unique + shared) / d if d else 0.0,
                "unique": unique,
                "shared": shared,
                "rho": rho_t,
                "histogram": hist,
                "lambda": lambdas,
            }
        )
    return {"participating": d, "unchanged": by_count[0], "by_count": by_count, "tasks": tasks}


def merge_ram(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float, lambdas: list[float]
) -> torch.Tensor:
    """The per-element rule; returns theta in the compute dtype (the caller casts it)."""
    b, taus, masks, count = _masks(base, tasks, eps)
    total = torch.zeros_like(b)
    lam = torch.zeros_like(b)
    for tau, m, lam_t in zip(taus, masks, lambdas, strict=True):
        total = total + torch.where(m, tau, 0.0)
        lam = torch.where(m, torch.tensor(lam_t, dtype=b.dtype), lam)
    unique = lam * total  # c == 1: the sum is the one active tau, exactly
    shared = total / count.to(b.dtype)
    merged = torch.where(count == 1, unique, shared)
    return torch.where(count == 0, b, b + merged)


@dataclass(frozen=True)
class RamMethod:
    """One configured member of the RAM family; `rule` gives lambda_t from rho_t."""

    name: str
    rule: Callable[[float, float, float], float]

    def params(self, **values: Any) -> RamParams:
        unknown = sorted(set(values) - {"r", "alpha", "eps"})
        if unknown:
            raise RamDistError(
                f"method {self.name} has no parameter {unknown[0]!r}; valid: r, alpha, eps"
            )
        return RamParams(**values)

    def chunk_statistics(
        self, base: torch.Tensor, tasks: list[torch.Tensor], params: RamParams
    ) -> torch.Tensor:
        return overlap_statistics(base, tasks, params.eps)

    def finalize(self, total: torch.Tensor, params: RamParams) -> dict[str, Any]:
        summary = summarize(total, params)
        summary["lambdas"] = [
            to_float32(self.rule(t["rho"], params.r, params.alpha)) for t in summary["tasks"]
        ]
        return summary

    def merge_chunk(
        self,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: RamParams,
        finalized: dict[str, Any],
    ) -> torch.Tensor:
        return merge_ram(base, tasks, params.eps, finalized["lambdas"])


LAMBDA_RULES: dict[str, Callable[[float, float, float], float]] = {
    "ram": lambda_ram,
    "ram_plus": lambda_ram_plus,
    "ram_plus_soft": lambda_ram_plus_soft,
}

for _name, _rule in LAMBDA_RULES.items():
    register(RamMethod(name=_name, rule=_rule))
