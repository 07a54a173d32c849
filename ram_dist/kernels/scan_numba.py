"""Fused NaN/Inf count of a stored tensor (numba): the reduce pass's finiteness check.

`(~torch.isfinite(x)).sum()` costs about 30 ns per element on bf16 (a widening copy, a bool
temporary, a reduction); this sweep looks at the raw bits of the stored dtype (exponent all
ones is NaN or Inf, in every IEEE format) and costs a fraction of a nanosecond, so checking
every input adds next to nothing to a pass that must read them anyway.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ram_dist.kernels import use_writable_cache

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Raw-bits view and exponent mask of each floating dtype the engine reads.
_EXPONENT = {
    torch.float64: (np.uint64, np.uint64(0x7FF0000000000000)),
    torch.float32: (np.uint32, np.uint32(0x7F800000)),
    torch.bfloat16: (np.uint16, np.uint16(0x7F80)),
    torch.float16: (np.uint16, np.uint16(0x7C00)),
}


@njit(cache=True, nogil=True, fastmath=False)
def _count(bits: np.ndarray, mask: np.integer) -> int:
    found = 0
    for i in range(bits.size):
        found += 1 if (bits[i] & mask) == mask else 0
    return found


def supports(dtype: torch.dtype) -> bool:
    return dtype in _EXPONENT


def nonfinite_count(x: torch.Tensor) -> int:
    """Number of NaN and Inf elements of a CPU tensor of a floating dtype in `_EXPONENT`."""
    if x.device.type != "cpu" or x.dtype not in _EXPONENT:
        raise TypeError(f"nonfinite_count takes CPU float tensors, got {x.dtype} on {x.device}")
    view, mask = _EXPONENT[x.dtype]
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return 0
    signed = {np.uint64: torch.int64, np.uint32: torch.int32, np.uint16: torch.int16}[view]
    bits = flat.view(signed).numpy().view(view)
    return int(_count(bits, mask))
