"""slerp, nuslerp, multislerp and karcher on whole tensors, written plainly from the spec
("The rest of mergekit's methods") and mergekit's formulas; it never imports ram_dist.

The spec's rules: every norm and dot product of a whole tensor (or row) is the exact sum of
the float32 products, rounded once to float64 (`math.fsum` of the float64 products, each
exact); angles and coefficients in float64 with Python's `math` (here partly numpy float64
matrix algebra on coefficient vectors: the same values up to float64 rounding, which the
float32 factors do not see); each factor that multiplies a tensor rounded to float32 once;
the blend element-wise in float32, one rounding per operation, in input order.

Inputs are torch tensors as stored (an FP8 tensor as its float32 value) or numpy arrays (taken
as float32 tensors). Task vectors (nuslerp, multislerp) are measured against the base at each
model's precision (`reference.task_vector`); slerp's model, and the one model multislerp
passes through, is its value as `reference.task_value` gives it; karcher has no base.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from reference import task_value, task_vector

F32 = np.float32


def f32(x: float) -> float:
    return float(F32(x))


def exact_dot(x: np.ndarray, y: np.ndarray) -> float:
    """The exact sum of the float32 products, rounded once to float64."""
    a = np.asarray(x, dtype=F32).astype(np.float64).ravel()
    b = np.asarray(y, dtype=F32).astype(np.float64).ravel()
    return math.fsum((a * b).tolist())


def gram(vectors: list[np.ndarray]) -> np.ndarray:
    n = len(vectors)
    return np.array([[exact_dot(vectors[i], vectors[j]) for j in range(n)] for i in range(n)])


def blend(vectors, factors, divisor=None, base=None) -> np.ndarray:
    """`((f_0 x_0 + f_1 x_1) + ...) / divisor + base` in float32, one rounding per op."""
    out = F32(factors[0]) * vectors[0]
    for x, f in zip(vectors[1:], factors[1:], strict=True):
        out = out + F32(f) * x
    if divisor is not None:
        out = out / F32(divisor)
    if base is not None:
        out = base + out
    return out.astype(F32)


def _np(x) -> np.ndarray:
    """float32 values of a tensor (any float dtype, bf16 included) or an array."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32).numpy()
    return np.asarray(x, dtype=F32)


def _torch(x) -> torch.Tensor:
    """A stored tensor as it is; an array as a float32 tensor."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(_np(x))


def _vector(base, model) -> np.ndarray:
    """The model's task vector, float32, against the base at the model's precision."""
    return task_vector(_torch(base), _torch(model)).numpy()


def _value(base, model) -> np.ndarray:
    """The model's float32 value as a method that blends values takes it."""
    return task_value(_torch(base), _torch(model)).numpy()


# ---------------------------------------------------------------- slerp


def slerp(base, model, t: float) -> np.ndarray:
    a, b = _np(base), _value(base, model)
    t = f32(t)
    na, nb = math.sqrt(exact_dot(a, a)), math.sqrt(exact_dot(b, b))
    na = na if na > 1e-8 else 1.0
    nb = nb if nb > 1e-8 else 1.0
    d = max(-1.0, min(1.0, exact_dot(a, b) / (na * nb)))
    if abs(d) > 0.9995:
        ca, cb = f32(1 - t), t
    else:
        theta = math.acos(d)
        ca = math.sin((1 - t) * theta) / math.sin(theta)
        cb = math.sin(t * theta) / math.sin(theta)
    return blend([a, b], [ca, cb])


# ---------------------------------------------------------------- nuslerp


def _nuslerp_pair(v0, v1, t: float) -> np.ndarray:
    n0 = max(math.sqrt(exact_dot(v0, v0)), 1e-7)
    n1 = max(math.sqrt(exact_dot(v1, v1)), 1e-7)
    c = max(-1.0, min(1.0, exact_dot(v0, v1) / (n0 * n1)))
    c32 = F32(c)
    if F32(1) - c32 * c32 <= F32(1e-16):  # mergekit's test, in float32
        return blend([v0, v1], [1 - t, t], 1.0)
    theta = math.acos(c)
    return blend([v0, v1], [math.sin((1 - t) * theta), math.sin(t * theta)], math.sin(theta))


def nuslerp(base, models, weights, flatten: bool = True, row_wise: bool = False) -> np.ndarray:
    """Task vectors of the two models, slerped whole (flatten), per vector along the last
    dimension, or (row_wise) per vector along the first dimension."""
    b = _np(base)
    v0, v1 = _vector(base, models[0]), _vector(base, models[1])
    total = weights[0] + weights[1]
    t = 0.5 if abs(total) < 1e-6 else weights[1] / total
    if flatten or b.ndim == 0:
        return (b + _nuslerp_pair(v0, v1, t)).astype(F32)
    if row_wise:  # mergekit transposes dims 0 and -1: vectors along the first dimension
        if b.ndim == 1:
            return (b + _nuslerp_pair(v0, v1, t)).astype(F32)
        x, y = np.moveaxis(v0, 0, -1), np.moveaxis(v1, 0, -1)
        pairs = zip(x.reshape(-1, b.shape[0]), y.reshape(-1, b.shape[0]), strict=True)
        merged = np.stack([_nuslerp_pair(p, q, t) for p, q in pairs])
        merged = np.moveaxis(merged.reshape(*x.shape), -1, 0)
        return (b + merged).astype(F32)
    rows = v0.reshape(-1, b.shape[-1]), v1.reshape(-1, b.shape[-1])
    merged = np.stack([_nuslerp_pair(x, y, t) for x, y in zip(*rows, strict=True)])
    return (b + merged.reshape(b.shape)).astype(F32)


# ---------------------------------------------------------------- multislerp


def multislerp(base, models, weights, normalize_weights=True, eps=1e-8) -> np.ndarray:
    """mergekit's steps on coefficient vectors over the task vectors x_i (all lie in their
    span), then the float32 blend of the x_i plus the base."""
    b = _np(base)
    if len(models) == 1:  # the one model passed through, as a value
        return _value(base, models[0])
    xs = [_vector(base, m) for m in models]
    g = gram(xs)
    n = len(xs)
    w = np.array([f32(x) for x in weights], dtype=np.float64)
    if normalize_weights:
        total = F32(0)
        for x in w:
            total = F32(total + F32(x))
        w = np.array([f32(x / float(total)) for x in w])
    if not np.diag(g).any():  # no task changed the tensor: the base (mergekit refuses it)
        return blend(xs, [0.0] * n, base=b)
    norms = np.sqrt(np.diag(g))
    units = np.diag(1 / (norms + eps))  # row i: the coefficients of u_i

    def length(c):
        return math.sqrt(max(float(c @ g @ c), 0.0))

    mean = w @ units
    mean_norm = length(mean)
    if mean_norm < eps:
        assert n == 2
        return blend(xs, list(w), base=b)
    mean = mean / mean_norm
    dots = units @ g @ mean
    tangents = units - np.outer(dots, mean)
    v = w @ tangents
    tn = length(v) + eps
    result = mean * math.cos(tn) + v * (math.sin(tn) / tn)
    result = result * float(norms @ w)
    return blend(xs, [float(r) for r in result], base=b)


# ---------------------------------------------------------------- karcher


def karcher(models, max_iter=10, tol=1e-5) -> np.ndarray:
    xs = [_np(m) for m in models]
    n = len(xs)
    if n == 1:
        return xs[0]
    g = gram(xs)
    alphas = np.full(n, 1.0 / n)
    norms = np.sqrt(np.diag(g))
    units = np.diag([1 / x if x != 0 else 0.0 for x in norms])
    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return np.zeros_like(xs[0])
    a = alphas[valid] / alphas[valid].sum()

    def length(c):
        return math.sqrt(max(float(c @ g @ c), 0.0))

    mean = a @ units[valid]
    mean_norm = length(mean)
    mean = units[valid[0]].copy() if mean_norm < tol else mean / mean_norm
    for _ in range(max_iter):
        tangent = np.zeros(n)
        for k, i in enumerate(valid):
            c = max(-1.0, min(1.0, float(mean @ g @ units[i])))
            theta = math.acos(c)
            if theta < tol:
                continue
            tangent = tangent + a[k] * (theta / math.sin(theta)) * (units[i] - c * mean)
        tn = length(tangent)
        if tn < tol:
            break
        mean = math.cos(tn) * mean + math.sin(tn) * (tangent / tn)
        un = length(mean)
        if un > tol:
            mean = mean / un
    scale = float(alphas @ norms)
    return blend(xs, [float(scale * m) for m in mean])
