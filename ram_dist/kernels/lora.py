"""A LoRA adapter's values, as the spec fixes them, in numpy (no torch): the rank-r product
in a fixed order, scaled, added to the base value and rounded to the task's dtype.

For a weight `W` and rows of it: `P[i, j] = sum_k coef[i, k] * basis[k, j]` in float32, k
ascending, every product and every addition rounded on its own (never a matrix multiply,
whose blocking, and so whose bytes, would depend on how the rows are split into units),
`delta = float32(s) * P`, and the value `cast(float32(theta_B) + delta)`. `coef` holds the
rows' factors (a Linear layer's `B` rows; the transposed `A` columns of an embedding or a
`fan_in_fan_out` layer) and `basis` the factor all rows share (`A`; `B` transposed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ram_dist.dtypes import INFO
from ram_dist.kernels import fp8


def _numba() -> Any:
    """The numba kernels (`lora_numba`), or None where numba is not installed: the numpy
    rule here gives the same bytes."""
    from ram_dist.kernels import numba_module

    return numba_module("lora_numba")


def as_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored elements (as bytes) of a floating dtype, as float32 values: exact for BF16,
    F16 and F32; F64 rounded to nearest even, as `float32(x)` in the spec."""
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F32":  # the bytes as they are: no copy per block of a factor read per unit
        return raw.view(np.float32)
    return raw.view(np.dtype(INFO[dtype].numpy)).astype(np.float32)


def cast(values: np.ndarray, dtype: str, out: np.ndarray) -> np.ndarray:
    """float32 `values` rounded to nearest even into `dtype`, as bytes written into `out`
    (a byte array at least that long); returns the bytes."""
    size = values.size * INFO[dtype].itemsize
    target = out[:size]
    if dtype == "BF16":
        target[:] = fp8.scale_bytes(values, "BF16")
    else:
        target.view(np.dtype(INFO[dtype].numpy))[:] = values
    return target


def values(
    theta: np.ndarray,
    theta_dtype: str,
    coef: np.ndarray,
    basis: np.ndarray,
    scale: np.float32,
    start: int,
    out_dtype: str,
    out: np.ndarray,
    fast: bool = True,
) -> np.ndarray:
    """The task's values of flat elements [start, start + n) of a weight whose rows are
    `basis.shape[1]` wide, as bytes of `out_dtype` in `out` (a byte array): `theta` holds the
    base's values of those elements (bytes of `theta_dtype`), `coef` [rows, r] the factors
    of the rows they touch, from the first (float32), `basis` [r, cols] (float32). `fast`:
    the numba kernel where numba is installed and the dtypes are its (the same bytes)."""
    kernels = _numba() if fast else None
    if kernels is not None and theta_dtype in _BITS and out_dtype in _BITS:
        n = theta.size // INFO[theta_dtype].itemsize
        dst = out[: n * INFO[out_dtype].itemsize].view(_BITS[out_dtype])
        kernels.lora_values(theta.view(_BITS[theta_dtype]), coef, basis, scale, start, dst)
        return dst.view(np.uint8)
    cols = basis.shape[1]
    base = as_float32(theta, theta_dtype)
    n = base.size
    row0, row1 = start // cols, -(-(start + n) // cols)
    c = coef[: row1 - row0]
    product = c[:, 0:1] * basis[0:1, :]
    for k in range(1, basis.shape[0]):
        product += c[:, k : k + 1] * basis[k : k + 1, :]
    flat = product.reshape(-1)[start - row0 * cols : start - row0 * cols + n]
    result = base + scale * flat
    return cast(result, out_dtype, out)


#: The array the numba kernel takes for each dtype: its stored elements or their bits.
_BITS = {"BF16": np.dtype(np.uint16), "F16": np.dtype(np.int16), "F32": np.dtype(np.float32)}
