"""The base at a task's precision (docs/exactness.md), in numpy: a task that stores a tensor
in bfloat16 or float16 measures its update against the base's value rounded to that dtype,
`theta_B^t = cast(x_B, p_t)` (round to nearest even), never against `x_B` itself. A trainer
that loads an FP8, INT4 or float32 base in bfloat16 trains from `cast(x_B, bf16)`, and saves
an element it never touched as exactly that value; measured against `x_B`, the rounding
alone would count as a change.

The cast is the identity when the task stores float32 or float64, or a quantized form (its
decoded float32 value is its value), and when it stores the base's own dtype: then nothing
changes. This module is the rule's one home for numpy callers (the methods' numpy paths, a
LoRA task's values); `methods.task_vectors` is the torch rule and `primitives.load_tile_bases`
the numba one, each tested against this one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ram_dist.kernels import fp8, quantized

#: The stored dtypes a base value is rounded to before a task stored in one measures its
#: update (a float32, float64 or decoded task takes the base's value as it is).
ROUNDED_DTYPES = ("BF16", "F16")

#: The safetensors dtype of each numpy array the engine hands the methods (bfloat16 as its
#: uint16 bits; float16 as itself, or as its int16 bits inside the kernels).
_ARRAY_DTYPES = {
    np.dtype(np.uint16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
}


def narrows(base: str, task: str) -> bool:
    """Whether a task whose values are of dtype `task` measures its update against the
    base's values (of dtype `base`: an FP8 base's are F32) rounded to `task`."""
    return task in ROUNDED_DTYPES and task != base


def array_dtype(values: np.ndarray | fp8.Fp8Values | quantized.QuantizedValues | tuple) -> str:
    """The safetensors dtype of an input's values as the engine or `views.kernel_view` hands
    them (bfloat16 as uint16; an FP8 input as stored, or as the kernels' tuple, is decoded
    to float32; a quantized input to its `values_dtype`, which its tuple's first member's
    dtype says)."""
    if isinstance(values, quantized.QuantizedValues):
        return values.values_dtype
    if isinstance(values, tuple) and len(values) == quantized.FIELDS:
        return _ARRAY_DTYPES[values[0].dtype]
    if isinstance(values, (fp8.Fp8Values, tuple)):
        return "F32"
    return _ARRAY_DTYPES[values.dtype]


def is_stored(values: object) -> bool:
    """Whether an input is a quantized one's stored form (`fp8.Fp8Values`,
    `quantized.QuantizedValues`), which the fused kernels decode as they load it; a numpy
    rule needs its decoded values instead."""
    return isinstance(values, (fp8.Fp8Values, quantized.QuantizedValues))


def value_count(values: Any) -> int:
    """Elements of a flat input as the engine or a test hands it: a stored form's values, a
    numpy array's or torch tensor's first dimension."""
    return int(values.size) if is_stored(values) else int(values.shape[0])


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `values` rounded to nearest even to `dtype` (BF16 or F16) and widened back to
    float32: torch's `x.to(dtype).float()`, bit for bit for finite values (an overflow gives
    inf; a NaN stays a quiet NaN)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F16":
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(np.float16).astype(np.float32)
    if dtype != "BF16":
        raise ValueError(f"a base value is rounded to bfloat16 or float16, not {dtype}")
    bits = values.view(np.uint32)
    top = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    top = np.where(np.isnan(values), (bits >> 16) | 0x40, top).astype(np.uint32)
    return (top << 16).view(np.float32)


def as_float32(values: np.ndarray) -> np.ndarray:
    """An input array as the engine hands it (bfloat16 as its uint16 bits, float16, float32)
    as float32 values, flat (exact)."""
    flat = values.reshape(-1)
    if flat.dtype == np.uint16:
        return (flat.astype(np.uint32) << 16).view(np.float32)
    if flat.dtype == np.int16:
        flat = flat.view(np.float16)
    return flat.astype(np.float32, copy=False)


def _measured(inputs: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[np.ndarray, Any]]]:
    """The base's float32 values, and per task its float32 values and the base at its
    precision where that is not the base itself (else None)."""
    base, *tasks = inputs
    b = as_float32(base)
    kind = array_dtype(base)
    out = []
    for task in tasks:
        own = array_dtype(task)
        out.append((as_float32(task), rounded(b, own) if narrows(kind, own) else None))
    return b, out


def task_vectors(inputs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The base's float32 values and each task's float32 update measured against the base at
    the task's precision, `float32(theta_t) - float32(cast(x_B, p_t))` (one rounding), from
    the inputs as the engine hands them (base first)."""
    b, measured = _measured(inputs)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, as in torch
        return b, [value - (b if at is None else at) for value, at in measured]


def task_values(inputs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The base's float32 values and each task's float32 values as a method that blends
    values (not updates) takes them: the task's own where its update is measured against the
    base itself, else the base plus its update, `x_B + tau_t` (one rounding), so that an
    element the task never touched is the base's value."""
    b, measured = _measured(inputs)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, as in torch
        return b, [value if at is None else b + (value - at) for value, at in measured]


#: The columns of `check_counts`: per task, the elements it changed (`|tau_t| > eps`), those
#: of them whose value is the base's rounded to bfloat16 or float16, and the elements whose
#: finite base value overflows the task's precision.
CHANGED, ROUNDING, OVERFLOW = 0, 1, 2


def counts_rounding(base: str) -> bool:
    """Whether a task's change may be the base rounded to a 16-bit dtype: the base holds
    more than 16 bits (float32, float64, or a quantized form). Only there does the check
    count changes and rounding."""
    return base not in ROUNDED_DTYPES


def needs_check(base: str, tasks: list[str]) -> bool:
    """Whether a tensor's precision check (`check_counts`) can find anything: rounding
    (`counts_rounding`), or a base value that overflows a task measuring against the base
    rounded to its dtype."""
    return counts_rounding(base) or any(narrows(base, t) for t in tasks)


def rounding_tests(task: str) -> tuple[str, ...]:
    """The 16-bit dtypes a changed value of a task stored in `task` is compared with the
    base rounded to: those that can find something. A bfloat16 task's value that is the base
    rounded to bfloat16 is no change (it is measured against that), and one that is the
    base rounded to float16 is then that too; a float16 task's, likewise for float16."""
    return {"BF16": (), "F16": ("BF16",)}.get(task, ("BF16", "F16"))


def check_counts(inputs: list[np.ndarray], eps: float) -> np.ndarray:
    """int64 [N, 3] (`CHANGED`, `ROUNDING`, `OVERFLOW`) of one chunk of the inputs as the
    engine hands them (base first), in float32: a change `tau_t` as the rule measures it
    (one rounding, `|tau_t| > float32(eps)`) is rounding when the task's value equals the
    base rounded to a 16-bit dtype (`rounding_tests`). `precision_numba.check_counts` is
    this, fused."""
    kind = array_dtype(inputs[0])
    with np.errstate(over="ignore", invalid="ignore"):
        b, taus = task_vectors(inputs)
        # finite as stored: a float64 beyond float32's range too (it overflows any 16 bits)
        finite = np.isfinite(inputs[0].reshape(-1) if kind == "F64" else b)
        roundings = {d: rounded(b, d) for d in ROUNDED_DTYPES}
        out = np.zeros((len(taus), 3), np.int64)
        for t, (task, tau) in enumerate(zip(inputs[1:], taus, strict=True)):
            own = array_dtype(task)
            value = as_float32(task)
            changed = np.abs(tau) > np.float32(eps)
            rounding = np.zeros_like(changed)
            for d in rounding_tests(own):
                rounding |= changed & (value == roundings[d])
            out[t, CHANGED] = int(changed.sum())
            out[t, ROUNDING] = int(rounding.sum())
            if narrows(kind, own):
                out[t, OVERFLOW] = int((finite & ~np.isfinite(rounded(b, own))).sum())
    return out
