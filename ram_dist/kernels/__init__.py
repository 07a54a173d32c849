"""Fused CPU kernels for the hot element-wise passes (optional: they need numba).

Import `ram_dist.kernels.ram_numba` only when `available()`; the eager torch methods give
the same bytes and remain the fallback (and the only path for float64 tensors).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def available() -> bool:
    """Whether numba is installed, so that `ram_dist.kernels.ram_numba` can be imported."""
    return importlib.util.find_spec("numba") is not None


def take(state: Mapping[str, Any], inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a fused kernel takes a chunk: kernels on for this job (`state["fused"]`, set by
    the engine from `--kernels`), CPU tensors, numba installed, and dtypes it reads."""
    if not state.get("fused") or inputs[0].device.type != "cpu" or not available():
        return False
    from ram_dist.kernels import ram_numba

    return ram_numba.supports([t.dtype for t in inputs])
