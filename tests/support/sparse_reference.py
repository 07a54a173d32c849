"""An independent reference of mergekit's generalized task arithmetic family as the spec pins
it (task_arithmetic, ties, dare_linear, dare_ties: "Baselines in the same engine";
breadcrumbs, breadcrumbs_ties, della, della_linear: "The rest of mergekit's methods") and of
`linear`, written from the spec (`../shared/spec/ram.md`) on whole tensors, plainly and slowly.
It never imports `ram_dist`.

* Task vectors: `delta_t` measured against the base at the task's precision
  (`reference.task_vector`); the merge is built on the base's own value.
* ties: keep the `max(1, int(density * n))` largest |delta| (ties at the cut: lowest flat
  index first).
* dare: keep element i where its counter-based draw (below) is below the density.
* breadcrumbs: order the elements by (-|delta|, flat index); keep the positions
  [a, a + target) with target = int(density * n), a = min(int(gamma * n), n - target).
* della: in each rank group (a 1-D tensor: the whole tensor; else along dimension 1), rank
  |delta| ascending 1..n with equal magnitudes ranked by flat index, the lowest highest;
  p = f32(density - epsilon) + (f32(r - 1) / f32(n - 1) * 2) * f32(epsilon); keep where the
  splitmix64 draw of (seed, task, name, flat index), top 24 bits / 2**24, is below p.
* L1 rescale: exact sums (fractions) rounded once to float32, the float32 ratio, skipped
  below 1e-7.
* Combine: float32, op by op, sums over tasks in task order from +0.
* linear: `sum_t w_t theta_t / sum_t w_t` in float32 from a +0 accumulator, each product
  rounded before its add; no base.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch
from reference import task_vector

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draws(seed: int, task: int, name: str, n: int) -> np.ndarray:
    """The spec's counter-based uniform draws of flat indices 0..n-1, as float32 (u < 1)."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    key = _mix(seed + _GOLDEN)
    key = _mix((key ^ task) + _GOLDEN)
    key = _mix((key ^ digest) + _GOLDEN)
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def _to_float32(q: Fraction) -> np.float32:
    """An exact non-negative rational rounded once to float32 (nearest, ties to even)."""
    if q == 0:
        return np.float32(0.0)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    step = Fraction(2) ** (max(e, -126) - 23)  # the float32 spacing at q
    m = q / step
    r = m.numerator // m.denominator
    rest = m - r
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and r % 2):
        r += 1
    return np.float32(float(r * step))


def _l1(x: torch.Tensor) -> np.float32:
    """The exact sum of |x| (each float32 an integer multiple of 2**-149), rounded once."""
    values = x.reshape(-1).double().abs().tolist()
    if any(v != v for v in values):
        return np.float32("nan")
    if any(v == float("inf") for v in values):
        return np.float32("inf")
    units = 0
    for v in values:
        num, den = v.as_integer_ratio()
        units += num * ((1 << 149) // den)
    return _to_float32(Fraction(units, 1 << 149))


def _masked(delta: torch.Tensor, keep: torch.Tensor, rescale: bool) -> torch.Tensor:
    masked = delta * keep.reshape(delta.shape).to(torch.float32)
    if not rescale:
        return masked
    before, after = _l1(delta), _l1(masked)
    eps = np.float32(1e-7)
    if before < eps or after < eps:
        return masked
    return masked * torch.tensor(float(np.float32(before / after)), dtype=torch.float32)


def _order(delta: torch.Tensor) -> np.ndarray:
    """Flat indices by (-|delta|, index), |delta| compared by its float32 bits."""
    keys = delta.reshape(-1).abs().view(torch.int32).numpy().astype(np.int64)
    return np.lexsort((np.arange(keys.size), -keys))


def breadcrumbs_mask(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    n = delta.numel()
    target = int(density * n)
    a = min(int(gamma * n), n - target)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.from_numpy(_order(delta)[a : a + target])] = True
    return keep


def della_mask(
    delta: torch.Tensor, density: float, epsilon: float, seed: int, task: int, name: str
) -> torch.Tensor:
    shape = tuple(delta.shape)
    flat = delta.reshape(-1)
    keys = flat.abs().view(torch.int32).numpy().astype(np.int64)
    index = np.arange(flat.numel())
    if len(shape) < 2:
        groups = index.reshape(1, -1)
    else:  # groups along dimension 1: (row, column of the inner dimensions)
        groups = index.reshape(shape[0], shape[1], -1).transpose(0, 2, 1).reshape(-1, shape[1])
    u = draws(seed, task, name, flat.numel())
    probs = np.empty(flat.numel(), dtype=np.float32)
    low, eps = np.float32(density - epsilon), np.float32(epsilon)
    for group in groups:
        n = group.size
        # ascending magnitude; equal magnitudes: the higher flat index first (ranks lower)
        ascending = group[np.lexsort((-group, keys[group]))]
        ranks = np.arange(1, n + 1)
        if n > 1:
            norm = (ranks - 1).astype(np.float32) / np.float32(n - 1)
        else:
            norm = np.full(n, 0.5, dtype=np.float32)
        probs[ascending] = low + (norm * np.float32(2)) * eps
    return torch.from_numpy(u < probs)


def _combine(base: torch.Tensor, deltas, weights, consensus: bool, normalize: bool, lam):
    w = [torch.tensor(x, dtype=torch.float32) for x in weights]
    weighted = [d * wt for d, wt in zip(deltas, w, strict=True)]

    def ordered(terms):
        total = torch.zeros_like(terms[0])
        for x in terms:
            total = total + x
        return total

    if consensus:
        sign = torch.where(ordered(weighted) >= 0, 1.0, -1.0)
        agree = [x.sign() == sign for x in weighted]
        mixed = ordered([x * m for x, m in zip(weighted, agree, strict=True)])
        divisor = ordered([wt * m for wt, m in zip(w, agree, strict=True)])
        divisor = torch.where(divisor == 0, 1.0, divisor)
    else:
        mixed = ordered(weighted)
        divisor = ordered(w)
        if divisor.abs() < 1e-8:
            divisor = torch.ones_like(divisor)
    if normalize:
        mixed = mixed / divisor
    if lam != 1:
        mixed = mixed * lam
    return base + mixed


#: Each member's sign election and its mergekit defaults of normalize and rescale.
CONSENSUS = ("ties", "dare_ties", "breadcrumbs_ties", "della")
NORMALIZE = ("ties", "della")
RESCALE = ("dare_linear", "dare_ties", "della", "della_linear")
METHODS = (
    "task_arithmetic", "ties", "dare_linear", "dare_ties",
    "breadcrumbs", "breadcrumbs_ties", "della", "della_linear",
)  # fmt: skip


def ties_mask(delta: torch.Tensor, density: float) -> torch.Tensor:
    """The `max(1, int(density * n))` largest |delta|, ties at the cut to the lowest index."""
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    k = max(1, int(density * delta.numel()))
    keep[torch.from_numpy(_order(delta)[:k])] = True
    return keep


def dare_mask(delta: torch.Tensor, density: float, seed: int, task: int, name: str) -> torch.Tensor:
    """Keep element i where its draw `u` (exact in float64) is below the density."""
    u = draws(seed, task, name, delta.numel()).astype(np.float64)
    return torch.from_numpy(u < density)


def sparse_merge(
    method: str,
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    name: str,
    weights: Sequence[float],
    densities: Sequence[float] | None = None,
    gammas: Sequence[float] = (),
    epsilons: Sequence[float] = (),
    normalize: bool | None = None,
    rescale: bool | None = None,
    lam: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """One tensor merged by `method` (one of `METHODS`) with mergekit's defaults where None;
    `base` and `tasks` as stored (an FP8 tensor as its float32 value)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    consensus = method in CONSENSUS
    if normalize is None:
        normalize = method in NORMALIZE
    if rescale is None:
        rescale = method in RESCALE
    if densities is None:
        densities = [1.0] * len(tasks)
    b = base.float()
    sparse = []
    for t, task in enumerate(tasks):
        delta = task_vector(base, task)
        if densities[t] >= 1 or method == "task_arithmetic":
            sparse.append(delta)
            continue
        if densities[t] <= 0 and method == "ties":
            sparse.append(torch.zeros_like(delta))
            continue
        if method.startswith("della"):
            keep = della_mask(delta, densities[t], epsilons[t], seed, t, name)
        elif method.startswith("dare"):
            keep = dare_mask(delta, densities[t], seed, t, name)
        elif method == "ties":
            keep = ties_mask(delta, densities[t])
        else:
            keep = breadcrumbs_mask(delta, densities[t], gammas[t])
        sparse.append(_masked(delta, keep, rescale))
    return _combine(b, sparse, weights, consensus, normalize, lam)


def linear(tasks: Sequence[torch.Tensor], weights: Sequence[float], normalize: bool = True):
    """mergekit's `linear`: the weighted mean of the models (no base; no task vectors)."""
    w = [torch.tensor(x, dtype=torch.float32) for x in weights]
    total = torch.zeros(tasks[0].shape, dtype=torch.float32)
    for x, wt in zip(tasks, w, strict=True):
        total = total + x.float() * wt
    if not normalize:
        return total
    divisor = torch.tensor(0.0)
    for wt in w:
        divisor = divisor + wt
    return total / divisor
