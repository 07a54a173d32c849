"""DARE (`dare_linear`, `dare_ties`): random drop of task-vector elements, L1 rescale.

Keep mask: element i of task t of tensor `name` is kept when its counter-based uniform draw
(`rng.py`) is below the density, compared exactly: `random_bits < ceil(density * 2**24)`.
mergekit draws from torch's global generator, which no chunked engine can reproduce, so its
masks are matched only in distribution (kept fraction, expected L1 norm).

Rescale (mergekit's L1 rule, `sparsify.rescaled_masked_tensor`): the kept vector is
multiplied by `||delta||_1 / ||kept||_1` over the whole tensor, skipped when either norm is
below 1e-7. mergekit computes both norms as float32 `abs().sum()`, compares them with 1e-7
as float32 and divides in float32, then multiplies the masked tensor by that float32 factor.

Chunk-independent L1 sums. Float addition is not associative, so no float accumulator
summed chunk by chunk can be independent of chunking. Instead the reduce pass sums exact
integers: every finite float32 |x| is `sig * 2**(max(E, 1) - 150)` with E its 8-bit biased
exponent and sig < 2**24 its integer significand (implicit bit included when E > 0). A
chunk's statistic is, per E, the int64 sum of sig (256 bins). Integer sums are associative,
so the per-tensor total is the same for any split, order or device; a bin cannot overflow
below 2**39 elements per tensor. The driver rebuilds the exact sum as a Python integer
(units of 2**-149) and rounds it to float32 once, to nearest-even. Bin 255 (inf/NaN) counts
1 per inf and 2**32 per NaN, so the driver can tell a NaN sum from an infinite one.
These correctly rounded norms can differ from mergekit's cascaded float32 sums in the last
bits, hence the factor (by one float32 ulp in about half of our trials): DARE with rescale
is not byte-identical to mergekit even with equal masks. At density >= 1 nothing is masked
or rescaled, and the results are byte-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

from ram_dist.methods.generalized_task_arithmetic.combine import combine, task_vectors
from ram_dist.methods.generalized_task_arithmetic.rng import BITS, random_bits

if TYPE_CHECKING:
    import torch

L1_BINS = 256
_SPECIAL = 255
_NAN_UNIT = 1 << 32
#: mergekit's tolerance below which a norm counts as zero (compared as float32).
RESCALE_EPS = 1e-7


def l1_statistic(values: torch.Tensor) -> torch.Tensor:
    """int64[256]: per float32 biased exponent, the exact sum of the significands of |x|."""
    import torch

    bits = values.to(torch.float32).abs().reshape(-1).view(torch.int32).to(torch.int64)
    exponent = bits >> 23
    frac = bits & 0x7FFFFF
    sig = torch.where(exponent > 0, frac | 0x800000, frac)
    sig = torch.where(exponent == _SPECIAL, torch.where(frac == 0, 1, _NAN_UNIT), sig)
    stat = torch.zeros(L1_BINS, dtype=torch.int64, device=values.device)
    return stat.index_add_(0, exponent, sig)


def _units(stat: torch.Tensor) -> int:
    """The exact finite part of the sum, in units of 2**-149."""
    bins = stat.cpu().tolist()
    return sum(bins[e] << max(e - 1, 0) for e in range(_SPECIAL))


def l1_exact(stat: torch.Tensor) -> Fraction | float:
    """The exact sum a statistic stands for (inf or nan when the tensor held one)."""
    special = int(stat[_SPECIAL])
    if special >= _NAN_UNIT:
        return math.nan
    if special > 0:
        return math.inf
    return Fraction(_units(stat), 1 << 149)


def l1_float32(stat: torch.Tensor) -> float:
    """The exact sum rounded once to float32, to nearest-even (returned as a Python float)."""
    import torch

    exact = l1_exact(stat)
    if not isinstance(exact, Fraction):
        return exact
    units = _units(stat)
    shift = max(units.bit_length() - 24, 0)
    q = units >> shift
    rem = units - (q << shift)
    half = 1 << (shift - 1) if shift else 0
    if shift and (rem > half or (rem == half and q & 1)):
        q += 1
    value = math.ldexp(q, shift - 149)  # exact in float64: q <= 2**24
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def rescale_factor(
    total: torch.Tensor, kept: torch.Tensor, eps: float = RESCALE_EPS
) -> float | None:
    """float32 `||delta||_1 / ||kept||_1` from two L1 statistics; None when either norm is
    below `eps` (mergekit's 1e-7; mergekitty's consensus methods skip below 1e-8)."""
    import torch

    before = torch.tensor(l1_float32(total), dtype=torch.float32)
    after = torch.tensor(l1_float32(kept), dtype=torch.float32)
    if before < eps or after < eps:
        return None
    return float(before / after)


def keep_threshold(density: float) -> int:
    """How many of the 2**24 equally likely draws u satisfy u < density, exactly."""
    scaled = Fraction(density) * (1 << BITS)
    return min(max(math.ceil(scaled), 0), 1 << BITS)


def dare_keep_mask(
    seed: int,
    task: int,
    name: str,
    start: int,
    stop: int,
    density: float,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """bool, one per flat index in [start, stop): keep with probability `density`."""
    bits = random_bits(seed, task, name, start, stop, device)
    return bits < keep_threshold(density)


def sparsify(delta: torch.Tensor, keep: torch.Tensor | None, factor: float | None) -> torch.Tensor:
    """mergekit's masked (and rescaled) tensor: `delta * mask`, then `* factor` if any.

    `keep=None` means the density is >= 1: mergekit returns the delta untouched.
    """
    import torch

    if keep is None:
        return delta
    masked = delta * keep.reshape(delta.shape).to(delta.dtype)
    if factor is None:
        return masked
    return masked * torch.tensor(factor, dtype=delta.dtype, device=delta.device)


def chunk_statistics(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    seed: int,
    name: str,
    start: int,
    densities: Sequence[float],
) -> torch.Tensor:
    """Reduce pass: int64[N, 2, 256], per task the L1 statistic of delta and of kept delta.

    Only needed when `rescale` is on; rows of tasks with density >= 1 stay zero.
    """
    import torch

    _, deltas = task_vectors(base, tasks)
    rows = []
    stop = start + base.numel()
    for t, (delta, density) in enumerate(zip(deltas, densities, strict=True)):
        if density >= 1:  # nothing is dropped nor rescaled: skip the draws
            rows.append(torch.zeros(2, L1_BINS, dtype=torch.int64, device=delta.device))
            continue
        keep = dare_keep_mask(seed, t, name, start, stop, density, delta.device)
        kept = delta.reshape(-1) * keep
        rows.append(torch.stack([l1_statistic(delta), l1_statistic(kept)]))
    return torch.stack(rows)


def rescale_factors(total: torch.Tensor, densities: Sequence[float]) -> list[float | None]:
    """Driver: per task the float32 factor from the summed int64[N, 2, 256] statistics."""
    return [
        None if density >= 1 else rescale_factor(total[t, 0], total[t, 1])
        for t, density in enumerate(densities)
    ]


def merge_chunk(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    seed: int,
    name: str,
    start: int,
    densities: Sequence[float],
    factors: Sequence[float | None],
    consensus: bool,
    normalize: bool = False,
    lambda_: float = 1.0,
) -> torch.Tensor:
    """Map pass of dare_linear (`consensus=False`) or dare_ties (`consensus=True`).

    `start` is the chunk's first flat index in its tensor; `factors` come from
    `rescale_factors` (all None when `rescale` is off). Returns the merged float32 values.
    """
    b, deltas = task_vectors(base, tasks)
    stop = start + b.numel()
    sparse = []
    for t, (delta, density, factor) in enumerate(zip(deltas, densities, factors, strict=True)):
        keep = None
        if density < 1:
            keep = dare_keep_mask(seed, t, name, start, stop, density, delta.device)
        sparse.append(sparsify(delta, keep, factor))
    return combine(b, sparse, weights, consensus=consensus, normalize=normalize, lambda_=lambda_)
