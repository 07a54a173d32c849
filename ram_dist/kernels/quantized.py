"""MXFP4, packed INT4/INT8 and compressed-tensors' FP8 (each value rounded to its scale's
dtype) inputs as the fused kernels read them: their codes and scales as stored, each value
decoded as the kernels load it (`quantized_spans`, called from `primitives.load_span`), in
place of a 16-bit copy of the values made first (block FP8, whose values are float32, has its
own form: `fp8.Fp8Values`).

One form for the three formats (`QuantizedValues`); `views.kernel_view` makes its tuple and
`views.kernel_inputs` its record, where the format and the values' dtype are values, not
types, so the kernels compiled for any input read it too.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ram_dist.kernels import int_packed, mxfp4

#: `QuantizedValues.format`: gpt-oss's MXFP4, compressed-tensors' packed INT4/INT8, and its
#: FP8 with a 16-bit scale (`float-quantized`, per channel or per tensor).
MXFP4, INT, FP8 = 0, 1, 2

#: The array a kernel takes for each dtype of decoded values (numba has no 16-bit floats):
#: an empty one of these is the kernel tuple's first member, which types it.
MARKERS = {"BF16": np.uint16, "F16": np.int16, "F32": np.float32}


class QuantizedValues(NamedTuple):
    """A block of a quantized input as stored: what `mxfp4.decode_bf16` or
    `int_packed.decode_in` decode, in a form the kernels decode value by value.

    MXFP4 (whole experts): `codes` the blocks' bytes ([E, rows, groups, 16] flat), `scales`
    each block's factor `2**(e8m0 - 127)` as float32 ([E, rows, groups]; a scale byte of 255
    is inf, so its values are NaN); the values are [E, groups * 32, rows].
    INT (whole rows): `codes` the packed words' bytes ([rows, words] flat), `scales` float32
    [rows, groups] (or one for the whole tensor, `groups` 1), `zeros` the signed zero points
    (int16, the scales' shape; empty where there are none); the values are [rows, cols],
    each `float32(q - zero) * scale` rounded to `values_dtype`.
    FP8 (whole rows): `codes` the e4m3 bytes ([rows, cols] flat), `scales` float32 [rows, 1]
    (per channel) or one (per tensor), no zeros; each value `float32(e4m3) * scale` rounded
    to `values_dtype`, as `planning.sources.Fp8Source.decode` with `rounded_to`."""

    format: int
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    rows: int
    cols: int
    groups: int
    size: int
    """Values in the block."""
    values_dtype: str
    """The dtype of the decoded values (`MARKERS`): BF16 for MXFP4, the scale's for INT."""


_NO_ZEROS = np.zeros(0, np.int16)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray, rows: int, groups: int) -> QuantizedValues:
    """Whole experts of an MXFP4 weight (flat uint8 blocks and scale bytes), undecoded."""
    raw = np.ascontiguousarray(scales).reshape(-1).view(np.uint8)
    return QuantizedValues(
        MXFP4, np.ascontiguousarray(blocks).reshape(-1).view(np.uint8), mxfp4_factors(raw),
        _NO_ZEROS, 4, rows, groups * mxfp4.GROUP, groups, raw.size * mxfp4.GROUP, "BF16",
    )  # fmt: skip


def mxfp4_factors(raw: np.ndarray) -> np.ndarray:
    """e8m0 scale bytes as the float32 factors `2**(s - 127)`, exact (0 gives 2**-127, a
    float32 subnormal; 255, e8m0's NaN, gives inf, which makes every value of its block
    inf or NaN, and so the NaN the decoder writes for it)."""
    factors = (raw.astype(np.uint32) << np.uint32(23)).view(np.float32)
    factors[raw == 0] = np.float32(2.0**-127)
    return factors


def int_values(
    words: np.ndarray,
    bits: int,
    rows: int,
    cols: int,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    dtype: str,
) -> QuantizedValues:
    """Whole rows of a packed INT weight (`int_packed.decode_in`'s arguments), undecoded."""
    if bits not in int_packed.BITS:
        raise ValueError(f"packed INT codes of {bits} bits")
    groups = scales.shape[1] if scales.ndim == 2 else 1
    if cols % groups:
        raise ValueError(f"{cols} columns in {groups} groups")
    z = _NO_ZEROS if zeros is None else np.ascontiguousarray(zeros, np.int16).reshape(-1)
    return QuantizedValues(
        INT, np.ascontiguousarray(words).reshape(-1).view(np.uint8),
        np.ascontiguousarray(scales, np.float32).reshape(-1), z, bits, rows, cols, groups,
        rows * cols, dtype,
    )  # fmt: skip


def fp8_values(
    q: np.ndarray, scales: np.ndarray, rows: int, cols: int, dtype: str
) -> QuantizedValues:
    """Whole rows of an FP8 weight whose values are rounded to `dtype` after their
    multiplication (compressed-tensors' FP8 with a bf16 scale): its e4m3 bytes and its
    float32 scales, one per row or one for the tensor, undecoded."""
    return QuantizedValues(
        FP8, np.ascontiguousarray(q).reshape(-1).view(np.uint8),
        np.ascontiguousarray(scales, np.float32).reshape(-1), _NO_ZEROS, 8, rows, cols, 1,
        rows * cols, dtype,
    )  # fmt: skip


def kernel_tuple(x: QuantizedValues) -> tuple:
    """The checked parts of a quantized input that `views.kernel_inputs` makes its record
    of: (marker, codes, scales, zeros, format, bits, rows, cols, groups, size, panel, key),
    the marker's dtype the values'; `panel` and `key` are MXFP4's scratch
    (`quantized_spans.load_mxfp4`; the record holds its own key), empty and unused for INT
    and FP8."""
    if x.format == MXFP4:
        need = (x.size // (x.cols * x.rows)) * x.rows * x.groups
        ok = x.size % (x.cols * x.rows) == 0 and x.scales.size == need
        ok = ok and x.codes.size == need * mxfp4.GROUP // 2
    else:
        per_row = x.cols if x.format == FP8 else int_packed.words_per_row(x.cols, x.bits) * 4
        ok = x.codes.size >= x.rows * per_row and x.size == x.rows * x.cols
        ok = ok and x.scales.size in (x.groups, x.rows * x.groups)
        ok = ok and x.zeros.size in (0, x.scales.size)
    if not ok:
        raise ValueError(f"quantized input of {x.size} values does not match its codes "
                         f"({x.codes.size} bytes) and scales ({x.scales.size})")  # fmt: skip
    marker = np.empty(0, MARKERS[x.values_dtype])
    panel = np.empty(x.rows * mxfp4.GROUP if x.format == MXFP4 else 0, np.uint16)
    return (
        marker, x.codes, x.scales, x.zeros, int(x.format), int(x.bits), int(x.rows),
        int(x.cols), int(x.groups), int(x.size), panel, np.full(1, -1, np.int64),
    )  # fmt: skip


#: Members of `kernel_tuple`'s tuple (an FP8 input's has 5).
FIELDS = 12
