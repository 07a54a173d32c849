"""Fused CPU kernels for the hot element-wise passes (optional: they need numba).

Import `ram_dist.kernels.ram_numba` only when `available()`; the eager torch methods give
the same bytes and remain the fallback (and the only path for float64 tensors).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether numba is installed, so that `ram_dist.kernels.ram_numba` can be imported."""
    return importlib.util.find_spec("numba") is not None
