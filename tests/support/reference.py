"""In-memory oracle of the RAM merge rule (/work/shared/spec/ram.md).

Whole tensors, plain torch, no chunking: written to be read against the spec line by line,
not to be fast. It never imports ram_dist, so it can judge the engine's bytes.

It is also the one home of the spec's "base at a task's precision" (`base_at`, `task_vector`,
`task_value`), which every other reference in this folder imports: a task stored in bf16 or
fp16 measures its update against the base rounded to its own dtype, any other task (float32,
float64, a quantized task's decoded float32 values) against the base's value itself.
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


# ---- the base at a task's precision (spec: "Definitions", first bullet) -----------------

#: The precisions a base value is rounded to before a task stored in one measures its update.
ROUNDED = (torch.bfloat16, torch.float16)


def narrows(x_base: torch.Tensor, task: torch.Tensor | torch.dtype) -> bool:
    """Whether `cast(x_B, p_t)` is not the identity: the task's precision `p_t` is bf16 or
    fp16 and the base's value is of another dtype. (`x_base` is the base's value as this
    folder hands it: its stored tensor, or float32 for a base stored in a quantized form;
    `task` a task's tensor as handed (float32 when decoded), or its precision.)"""
    dtype = task if isinstance(task, torch.dtype) else task.dtype
    return dtype in ROUNDED and dtype != x_base.dtype


def base_at(x_base: torch.Tensor, task: torch.Tensor | torch.dtype) -> torch.Tensor:
    """`theta_B^t = cast(x_B, p_t)`: the base's value rounded to nearest even to the task's
    precision (torch's `.to()`), or `x_B` itself when the cast is the identity (`p_t` F32, F64,
    decoded, or the base's own dtype). A finite `x_B` that overflows `p_t` is refused."""
    if not narrows(x_base, task):
        return x_base
    dtype = task if isinstance(task, torch.dtype) else task.dtype
    rounded = x_base.to(dtype)
    overflow = torch.isfinite(x_base) & ~torch.isfinite(rounded)
    if bool(overflow.any()):
        raise ValueError(f"a finite base value overflows {dtype}: refused")
    return rounded


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input of the tensor is F64, else float32."""
    return torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32


def task_vector(
    x_base: torch.Tensor, task: torch.Tensor, cdt: torch.dtype = torch.float32
) -> torch.Tensor:
    """`tau_t = cdt(theta_t) - cdt(theta_B^t)`: one rounding in the compute dtype."""
    return task.to(cdt) - base_at(x_base, task).to(cdt)


def task_value(x_base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    """A task's float32 value as a method that blends values (not task vectors) takes it:
    `float32(x_B) + tau_t` (one float32 rounding) for a task that narrows, so that an element
    it never touched is exactly the base's value; its own float32 value otherwise."""
    if narrows(x_base, task):
        return x_base.to(torch.float32) + task_vector(x_base, task)
    return task.to(torch.float32)


# ---- the RAM rule ------------------------------------------------------------------------


def _task_vectors(
    base: State, tasks: list[State], name: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(compute(x_B), [tau_t]) in float32, or float64 if any input of `name` is F64; each
    tau_t measured against the base at that task's precision."""
    cdt = compute_dtype(base[name], *(task[name] for task in tasks))
    return base[name].to(cdt), [task_vector(base[name], task[name], cdt) for task in tasks]


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


def tensor_lambda(unique: int, shared: int, r: float, alpha: float, eps: float) -> float:
    """mergekit's `ramplus_tl` lambda of one tensor (the spec's `scope: tensor`), from that
    tensor's own counts, as mergekit's expression evaluates it in torch:
    `1 + r * (shared / unique.clamp(min=eps)).clamp(0, alpha)`; returned as its float32."""
    rho = torch.tensor(shared, dtype=torch.int64) / torch.tensor(unique).clamp(min=eps)
    return float(1 + r * rho.clamp(min=0, max=alpha))


def reference_merge(
    base: State,
    tasks: list[State],
    method: str,
    r: float = 0.1,
    alpha: float | None = None,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> tuple[State, dict]:
    """Merge `tasks` into `base` by the spec; returns (merged state, stats). `method` is one of
    `METHODS`, or `ramplus_tl` (RAM+ with lambda per tensor, mergekit's defaults: alpha 0.2);
    alpha defaults to 2.0 otherwise."""
    tensor_scope = method == "ramplus_tl"
    if alpha is None:
        alpha = 0.2 if tensor_scope else 2.0
    stats = reference_stats(base, tasks, eps)
    lam64 = reference_lambdas(stats["rho"], "ram_plus" if tensor_scope else method, r, alpha)
    lam32 = [to_float32(x) for x in lam64]
    stats["lambda64"], stats["lambda32"] = lam64, lam32
    if tensor_scope:
        stats["lambda_per_tensor"] = {}
    out: State = {}
    for name, tensor in base.items():
        if tensor.dtype not in FLOAT_DTYPES:
            out[name] = tensor.clone()  # copied from B; out_dtype does not apply
            continue
        base_c, taus = _task_vectors(base, tasks, name)
        cdt = base_c.dtype
        masks, c = _masks(taus, eps)
        lams = lam32
        if tensor_scope:
            lams = [
                tensor_lambda(int((m & (c == 1)).sum()), int((m & (c >= 2)).sum()), r, alpha, eps)
                for m in masks
            ]
            stats["lambda_per_tensor"][name] = lams
        # c >= 2: sum in task order (masked-out tasks add exact zeros), divided once by c.
        s = torch.zeros_like(base_c)
        for tau, m in zip(taus, masks, strict=True):
            s = s + torch.where(m, tau, 0.0)
        merged = s / c.clamp(min=1).to(cdt)
        # c == 1: lambda_t (already rounded to float32) times tau of the one active task.
        for t, (tau, m) in enumerate(zip(taus, masks, strict=True)):
            lam = torch.tensor(lams[t], dtype=cdt)
            merged = torch.where(m & (c == 1), lam * tau, merged)
        # c == 0: exactly the base's own value x_B (keeps a base of -0.0 as -0.0), never a
        # task's view of it; otherwise x_B + merged, whatever precision the tasks measured at.
        theta = torch.where(c == 0, base_c, base_c + merged)
        out[name] = theta.to(out_dtype or tensor.dtype)
    return out, stats
