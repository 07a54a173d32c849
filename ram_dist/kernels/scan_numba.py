"""Fused NaN/Inf count of a stored tensor (numba): the reduce pass's finiteness check.

`(~torch.isfinite(x)).sum()` costs about 30 ns per element on bf16 (a widening copy, a bool
temporary, a reduction); this sweep looks at the raw bits of the stored dtype (exponent all
ones is NaN or Inf, in every IEEE format) and costs a fraction of a nanosecond, so checking
every input adds next to nothing to a pass that must read them anyway.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from ram_dist.dtypes import FLOATING, INFO, ITEMSIZE
from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.shared_cache import share_compiles

if TYPE_CHECKING:
    import torch

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


def _unsigned(dtype: str, mask: int) -> tuple[type, np.unsignedinteger]:
    """The unsigned integers of the dtype's width (its raw bits), and the mask as one."""
    kind = np.dtype(f"u{ITEMSIZE[dtype]}").type
    return kind, kind(mask)


#: Raw-bits view and exponent mask of each floating safetensors dtype the engine reads.
_EXPONENT = {d: _unsigned(d, INFO[d].exponent) for d in sorted(FLOATING)}


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
    import torch

    from ram_dist.dtypes import TORCH_TO_SAFETENSORS

    name = TORCH_TO_SAFETENSORS.get(x.dtype, "")
    if x.device.type != "cpu" or name not in _EXPONENT:
        raise TypeError(f"nonfinite_count takes CPU float tensors, got {x.dtype} on {x.device}")

    flat = x.reshape(-1).contiguous()
    if flat.numel() == 0:
        return 0
    return nonfinite_in(flat.view(torch.uint8).numpy(), name)


def warm_calls() -> Iterator[Call]:
    """The finiteness scan reads raw bits: one signature per width, float64 included
    (`kernels.warm`)."""
    import torch

    from ram_dist.kernels.warm import N

    for name in ("bfloat16", "float32", "float64"):
        x = torch.zeros(N, dtype=getattr(torch, name))
        yield _count, name, partial(nonfinite_count, x)


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
