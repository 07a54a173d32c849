"""A LoRA adapter's values, as the spec fixes them, in numpy (no torch): the rank-r product
in a fixed order, scaled, added to the base value and rounded to the task's dtype.

For a weight `W` and rows of it: `P[i, j] = sum_k coef[i, k] * basis[k, j]` in float32, k
ascending, every product and every addition rounded on its own (never a matrix multiply,
whose blocking, and so whose bytes, would depend on how the rows are split into units),
`delta = float32(s) * P`, and the value `cast(float32(theta_B) + delta)`. `coef` holds the
rows' factors (a Linear layer's `B` rows; the transposed `A` columns of an embedding or a
`fan_in_fan_out` layer) and `basis` the factor all rows share (`A`; `B` transposed).

`theta_B` is the base at the task's precision: the base's value rounded to the task's dtype
where that is a 16-bit dtype the base's values are not in (an FP8 or float32-scaled INT base
under an adapter trained on the base loaded in bfloat16), `kernels.precision`'s rule. A
quantized base (`fp8.Fp8Values`, `quantized.QuantizedValues`) is read as stored: the kernel
decodes each tile of its values as it loads it, so no copy of the base's values is made.

In a process told to (`compute_on`: a GPU worker's), the product is computed with torch on
that device instead (`lora_torch`), by the same rule: the same bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ram_dist.dtypes import INFO
from ram_dist.kernels import fp8, int_packed, mxfp4, precision, quantized

#: The torch device this process computes the products on (`compute_on`); None: the kernels.
_DEVICE: str | None = None


def compute_on(device: str | None) -> None:
    """Compute this process's LoRA products with torch on `device` ("cuda", or "cpu" where a
    GPU worker has no CUDA: Ray's fake GPUs in tests), or with the kernels (None). A GPU
    worker process says so once, when it starts (`engine.gpu`): its units' blocks are read,
    and their products made, by threads of its own."""
    global _DEVICE
    _DEVICE = device


def computing_on() -> str | None:
    """The device `compute_on` named for this process (None: the kernels)."""
    return _DEVICE


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


#: A base's values as `values` takes them: its stored elements' bytes, or a quantized
#: base's stored form.
Theta = np.ndarray | fp8.Fp8Values | quantized.QuantizedValues


def values(
    theta: Theta,
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
    base's values of those elements (bytes of `theta_dtype`, or a quantized base's stored
    form, whose values are of `theta_dtype`), rounded to `out_dtype` first where the task
    measures against the base at its precision (`precision.narrows`); `coef` [rows, r] the
    factors of the rows they touch, from the first (float32), `basis` [r, cols] (float32).
    `fast`: the numba kernel where numba is installed and the dtypes are its, or torch on
    the device `compute_on` named (the same bytes); the numpy rule decodes a stored form
    first."""
    stored = precision.is_stored(theta)
    rounded = out_dtype if precision.narrows(theta_dtype, out_dtype) else "F32"
    if fast and _DEVICE is not None:
        from ram_dist.kernels import lora_torch

        base = _base(theta, theta_dtype, rounded)
        return cast(lora_torch.values(base, coef, basis, scale, start, _DEVICE), out_dtype, out)
    kernels = _numba() if fast else None
    if kernels is not None and (stored or theta_dtype in _BITS) and out_dtype in _BITS:
        from ram_dist.kernels import primitives, views

        n = precision.value_count(theta) if stored else theta.size // INFO[theta_dtype].itemsize
        src = views.kernel_record(theta, False) if stored else theta.view(_BITS[theta_dtype])
        dst = out[: n * INFO[out_dtype].itemsize].view(_BITS[out_dtype])
        kind = {"BF16": primitives.BF16, "F16": primitives.F16}.get(rounded, primitives.F32)
        kernels.lora_values(src, coef, basis, scale, start, kind, dst)
        return dst.view(np.uint8)
    cols = basis.shape[1]
    base = _base(theta, theta_dtype, rounded)
    n = base.size
    row0, row1 = start // cols, -(-(start + n) // cols)
    c = coef[: row1 - row0]
    product = c[:, 0:1] * basis[0:1, :]
    for k in range(1, basis.shape[0]):
        product += c[:, k : k + 1] * basis[k : k + 1, :]
    flat = product.reshape(-1)[start - row0 * cols : start - row0 * cols + n]
    result = base + scale * flat
    return cast(result, out_dtype, out)


def _base(theta: Theta, theta_dtype: str, rounded: str) -> np.ndarray:
    """The base's float32 values (a stored form decoded in numpy), rounded to `rounded`
    unless that is F32: `theta_B^t`."""
    stored = precision.is_stored(theta)
    base = _decoded(theta) if stored else as_float32(theta, theta_dtype)
    return precision.rounded(base, rounded) if rounded != "F32" else base


def _decoded(x: fp8.Fp8Values | quantized.QuantizedValues) -> np.ndarray:
    """A stored form's float32 values, in numpy (the rule the kernel's loads follow): block
    FP8's `float32(q) * scale`; MXFP4's `e2m1 * 2**(s - 127)` (NaN where not finite), packed
    INT's `float32(q - zero) * scale` and rounded FP8's `float32(q) * scale`, each rounded to
    the values' dtype."""
    if isinstance(x, fp8.Fp8Values):
        return x.values()
    f32 = np.float32
    if x.format == quantized.MXFP4:
        experts = x.size // (x.rows * x.cols)
        codes = x.codes.reshape(experts, x.rows, x.groups, mxfp4.GROUP // 2)
        factors = x.scales.reshape(experts, x.rows, x.groups, 1)
        unpacked = np.empty((experts, x.rows, x.groups, mxfp4.GROUP), f32)
        with np.errstate(over="ignore", invalid="ignore"):
            unpacked[..., 0::2] = mxfp4.E2M1[codes & 0x0F] * factors
            unpacked[..., 1::2] = mxfp4.E2M1[codes >> 4] * factors
        unpacked[~np.isfinite(unpacked)] = np.nan
        return unpacked.reshape(experts, x.rows, x.cols).transpose(0, 2, 1).reshape(-1)
    scales = x.scales.reshape(-1, x.groups)
    if x.format == quantized.FP8:
        q = fp8.E4M3_VALUES[x.codes[: x.size]].reshape(x.rows, x.cols)
        values = (q * scales.reshape(-1, 1)).astype(f32).reshape(-1)
    else:
        codes = int_packed.unpack_rows(x.codes, x.bits, x.rows, x.cols)
        zeros = x.zeros.reshape(-1, x.groups) if x.zeros.size else None
        values = int_packed.decode(codes, zeros, scales, np.empty(x.size, f32))
    return as_float32(int_packed.in_dtype(values, x.values_dtype), x.values_dtype)


#: The array the numba kernel takes for each dtype: its stored elements or their bits.
_BITS = {"BF16": np.dtype(np.uint16), "F16": np.dtype(np.int16), "F32": np.dtype(np.float32)}
