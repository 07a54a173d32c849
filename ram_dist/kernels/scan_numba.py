"""Fused NaN/Inf count of a stored tensor (numba): the reduce pass's finiteness check.

`(~torch.isfinite(x)).sum()` costs about 30 ns per element on bf16 (a widening copy, a bool
temporary, a reduction); this sweep looks at the raw bits of the stored dtype (exponent all
ones is NaN or Inf, in every IEEE format) and costs a fraction of a nanosecond, so checking
every input adds next to nothing to a pass that must read them anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from ram_dist.kernels import use_writable_cache

if TYPE_CHECKING:
    import torch

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: Raw-bits view and exponent mask of each floating safetensors dtype the engine reads.
_EXPONENT = {
    "F64": (np.uint64, np.uint64(0x7FF0000000000000)),
    "F32": (np.uint32, np.uint32(0x7F800000)),
    "BF16": (np.uint16, np.uint16(0x7F80)),
    "F16": (np.uint16, np.uint16(0x7C00)),
}
_TORCH_NAMES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@njit(cache=True, nogil=True, fastmath=False)
def _count(bits: np.ndarray, mask: np.integer) -> int:
    found = 0
    for i in range(bits.size):
        found += 1 if (bits[i] & mask) == mask else 0
    return found


def supports(dtype: str) -> bool:
    """Whether a safetensors dtype is one this sweep counts."""
    return dtype in _EXPONENT


def nonfinite_in(raw: np.ndarray, dtype: str) -> int:
    """Number of NaN and Inf elements in the stored bytes (or any array over them) of a
    tensor of safetensors dtype `dtype` (one of `_EXPONENT`)."""
    view, mask = _EXPONENT[dtype]
    if raw.size == 0:
        return 0
    return int(_count(np.ravel(raw).view(view), mask))


def nonfinite_count(x: torch.Tensor) -> int:
    """Number of NaN and Inf elements of a CPU tensor of a floating dtype in `_EXPONENT`."""
    name = _TORCH_NAMES.get(str(x.dtype).removeprefix("torch."))
    if x.device.type != "cpu" or name is None:
        raise TypeError(f"nonfinite_count takes CPU float tensors, got {x.dtype} on {x.device}")
    import torch

    flat = x.reshape(-1).contiguous()
    if flat.numel() == 0:
        return 0
    return nonfinite_in(flat.view(torch.uint8).numpy(), name)
