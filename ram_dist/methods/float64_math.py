"""`exp` and `log` of float64 tensors from IEEE additions, multiplications and divisions
alone, so the bits are the same on any device.

torch's and numpy's `exp` and `log` are library code whose last bit depends on the device
and on the SIMD path (a vectorized loop and its scalar tail may differ). These are the
classic reductions (fdlibm's): `exp(x) = 2**k * exp(r)`, `|r| <= ln2 / 2`, by a Taylor
polynomial in Horner form; `log(x) = e ln2 + 2 atanh(f)`, `f = (m - 1) / (m + 1)`,
`m in [sqrt(1/2), sqrt(2))`, by its odd series. Each step is one correctly rounded
operation of a separate torch kernel (no fused multiply-add), so CPU and GPU agree to the
bit. Accuracy: a few float64 ulps, far below the float32 results they feed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_LN2_HI = 6.93147180369123816490e-01  # ln 2 with its low 32 bits zero: k * _LN2_HI exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_TERMS = 14
_LOG_TERMS = 13
_EXP_MAX = 709.782712893384  # above: inf
_EXP_MIN = -745.1332191019412  # below: 0
_SQRT2 = math.sqrt(2.0)
#: 1/n as Python floats: a tensor divided by a Python scalar is a true division on the CPU
#: but a multiplication by its reciprocal on CUDA, so no step here divides by a scalar.
_INVERSE = [math.inf] + [1.0 / n for n in range(1, _EXP_TERMS + 1)]


def _two_to(k: torch.Tensor) -> torch.Tensor:
    """2.0**k as float64, exact, for integer-valued k in [-1022, 1023]."""
    import torch

    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x, elementwise, for a float64 tensor."""
    import torch

    clamped = x.clamp(min=_EXP_MIN - 1, max=_EXP_MAX + 1)
    k = torch.round(clamped * _INV_LN2)
    r = (clamped - k * _LN2_HI) - k * _LN2_LO
    p = torch.ones_like(r)
    for n in range(_EXP_TERMS, 0, -1):  # 1 + r/1 (1 + r/2 (1 + ... (1 + r/14)))
        p = 1 + (r * _INVERSE[n]) * p  # times a constant: no tensor / scalar (see above)
    half = torch.floor(k * 0.5)  # exact: k is an integer
    out = p * _two_to(half) * _two_to(k - half)  # two steps: 2**k may be out of range
    out = torch.where(x > _EXP_MAX, torch.full_like(x, math.inf), out)
    out = torch.where(x < _EXP_MIN, torch.zeros_like(x), out)
    return torch.where(torch.isnan(x), x, out)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log, elementwise, for a float64 tensor (-inf at 0, NaN below)."""
    import torch

    tiny = x < 2.0**-1022
    scaled = torch.where(tiny, x * 2.0**54, x)  # subnormals made normal, exactly
    bits = scaled.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023 - torch.where(tiny, 54, 0)
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # in [1, 2)
    high = m > _SQRT2
    m = torch.where(high, m * 0.5, m)
    e = (e + high.to(torch.int64)).to(torch.float64)
    f = (m - 1) / (m + 1)
    s = f * f
    series = torch.full_like(s, 1.0 / (2 * _LOG_TERMS + 1))
    for n in range(_LOG_TERMS - 1, -1, -1):  # sum s**n / (2n + 1)
        series = 1.0 / (2 * n + 1) + s * series
    log_m = 2 * f * series
    out = e * _LN2_HI + (e * _LN2_LO + log_m)
    out = torch.where(x == 0, torch.full_like(x, -math.inf), out)
    out = torch.where(x == math.inf, x, out)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(x, math.nan), out)
