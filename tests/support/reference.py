"""In-memory oracle of the RAM merge rule (/work/shared/spec/ram.md).

Whole tensors, plain torch, no chunking: written to be read against the spec line by line,
not to be fast. It never imports ram_dist, so it can judge the engine's bytes.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
METHODS = ("ram", "ram_plus", "ram_plus_soft")

State = dict[str, torch.Tensor]


def _check_inputs(base: State, tasks: list[State]) -> None:
    """Every task must hold exactly the tensor names and shapes of the base."""
    if not tasks:
        raise ValueError("need at least one task")
    for t, task in enumerate(tasks):
        if set(task) != set(base):
            extra, missing = sorted(set(task) - set(base)), sorted(set(base) - set(task))
            raise ValueError(f"task {t}: extra tensors {extra}, missing tensors {missing}")
        for name, tensor in base.items():
            if task[name].shape != tensor.shape:
                raise ValueError(
                    f"task {t}: {name} shape {tuple(task[name].shape)} "
                    f"!= base {tuple(tensor.shape)}"
                )


def _task_vectors(
    base: State, tasks: list[State], name: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(compute(theta_B), [tau_t]) in float32, or float64 if any input of `name` is F64."""
    inputs = [base[name]] + [task[name] for task in tasks]
    cdt = torch.float64 if any(x.dtype == torch.float64 for x in inputs) else torch.float32
    base_c = base[name].to(cdt)
    return base_c, [task[name].to(cdt) - base_c for task in tasks]


def _masks(taus: list[torch.Tensor], eps: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    """m_t = |tau_t| > eps (strict, compared in the compute dtype); c = sum_t m_t."""
    masks = [tau.abs() > eps for tau in taus]
    c = torch.zeros(taus[0].shape, dtype=torch.int64)
    for m in masks:
        c = c + m.to(torch.int64)
    return masks, c


def reference_stats(base: State, tasks: list[State], eps: float = 1e-5) -> dict:
    """Global overlap statistics over all floating elements of the whole model."""
    _check_inputs(base, tasks)
    n = len(tasks)
    hist = [[0] * n for _ in range(n)]  # hist[t][k-1] = H[t][k]
    d = unchanged = 0
    for name in sorted(base):
        if base[name].dtype not in FLOAT_DTYPES:
            continue
        _, taus = _task_vectors(base, tasks, name)
        masks, c = _masks(taus, eps)
        d += c.numel()
        unchanged += int((c == 0).sum())
        for t, m in enumerate(masks):
            counts = torch.bincount(c[m].reshape(-1), minlength=n + 1)
            for k in range(1, n + 1):
                hist[t][k - 1] += int(counts[k])
    unique = [row[0] for row in hist]
    shared = [sum(row[1:]) for row in hist]
    pairs = list(zip(unique, shared, strict=True))
    density = [(u + s) / d if d else 0.0 for u, s in pairs]
    rho = [s / u if u else (math.inf if s > 0 else 0.0) for u, s in pairs]
    return {
        "d": d,
        "unchanged": unchanged,
        "H": hist,
        "unique": unique,
        "shared": shared,
        "density": density,
        "rho": rho,
    }


def reference_lambdas(
    rho: list[float], method: str, r: float = 0.1, alpha: float = 2.0
) -> list[float]:
    """lambda_t in float64 (python floats), before the single float32 rounding."""
    if method == "ram":
        return [1.0 for _ in rho]
    if method == "ram_plus":
        return [1 + r * min(max(x, 0.0), alpha) for x in rho]
    if method == "ram_plus_soft":
        return [1 + r if math.isinf(x) else 1 + r * x / (1 + x) for x in rho]
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def to_float32(x: float) -> float:
    """Round a python float to the nearest float32 (round to nearest even)."""
    return float(torch.tensor(x, dtype=torch.float32))


def reference_merge(
    base: State,
    tasks: list[State],
    method: str,
    r: float = 0.1,
    alpha: float = 2.0,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> tuple[State, dict]:
    """Merge `tasks` into `base` by the spec; returns (merged state, stats)."""
    stats = reference_stats(base, tasks, eps)
    lam64 = reference_lambdas(stats["rho"], method, r, alpha)
    lam32 = [to_float32(x) for x in lam64]
    stats["lambda64"], stats["lambda32"] = lam64, lam32
    out: State = {}
    for name, tensor in base.items():
        if tensor.dtype not in FLOAT_DTYPES:
            out[name] = tensor.clone()  # copied from B; out_dtype does not apply
            continue
        base_c, taus = _task_vectors(base, tasks, name)
        cdt = base_c.dtype
        masks, c = _masks(taus, eps)
        # c >= 2: sum in task order (masked-out tasks add exact zeros), divided once by c.
        s = torch.zeros_like(base_c)
        for tau, m in zip(taus, masks, strict=True):
            s = s + torch.where(m, tau, 0.0)
        merged = s / c.clamp(min=1).to(cdt)
        # c == 1: lambda_t (already rounded to float32) times tau of the one active task.
        for t, (tau, m) in enumerate(zip(taus, masks, strict=True)):
            lam = torch.tensor(lam32[t], dtype=cdt)
            merged = torch.where(m & (c == 1), lam * tau, merged)
        # c == 0: exactly the base value (keeps a base of -0.0 as -0.0).
        theta = torch.where(c == 0, base_c, base_c + merged)
        out[name] = theta.to(out_dtype or tensor.dtype)
    return out, stats
