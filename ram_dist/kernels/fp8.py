"""FP8 (e4m3fn) block quantization as the spec fixes it, in numpy (no torch).

Hugging Face's "fine-grained FP8" stores a weight `W` [R, C] as e4m3fn bytes and a companion
`W_scale_inv` [ceil(R/bm), ceil(C/bn)]: the value of an element is `float32(W[i, j]) *
float32(S[i // bm, j // bn])`, one float32 multiplication. The way back, per block, is a
fresh scale `amax / 448` and each value divided by it, rounded to the nearest e4m3fn value
(ties to even, saturated to +-448: e4m3fn has no infinity). A block whose merged values are
the base's, bit for bit, keeps the base's bytes and scale.

Everything works on whole bands (`bm` rows, the last one ragged) of row-major data, so a
work unit that covers whole bands computes every block it writes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

#: The largest finite e4m3fn value.
E4M3_MAX = np.float32(448.0)


def _e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes (exact: 3 mantissa bits, bias 7)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = man * 2.0**-9
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(exp == 0xF) & (man == 0x7)] = np.nan  # 0x7F and 0xFF: e4m3fn's only NaNs
    return values.astype(np.float32)


#: `E4M3_VALUES[code]` is the float32 value of an e4m3fn byte.
E4M3_VALUES = _e4m3_values()


class Fp8Values(NamedTuple):
    """An FP8 input as the fused kernels read it, in place of a float32 copy of its values:
    the e4m3fn bytes of whole rows of `cols` starting on a band's first row, and the float32
    scales of those bands (`block` = (bm, bn) elements each). The kernels compute each value
    as `dequantize` does, one float32 multiplication, as they load it."""

    q: np.ndarray
    scales: np.ndarray
    cols: int
    block: tuple[int, int]

    @property
    def size(self) -> int:
        return int(self.q.size)

    def values(self, out: np.ndarray | None = None) -> np.ndarray:
        """The float32 values (`dequantize`), into `out` when given."""
        out = np.empty(self.size, np.float32) if out is None else out
        return dequantize(self.q, self.scales, self.cols, self.block, out)


class Fp8Target(NamedTuple):
    """Where a fused merge writes an FP8 output (`requantize`'s rule, in the kernel): the
    e4m3fn bytes (`q`, empty for the scales only), the dtype the scales are stored in, the
    base's raw scale bytes of the same bands (an unchanged block keeps its own), and where
    the bands' scale bytes go (`scales`, as many bytes as `base_scales`)."""

    q: np.ndarray
    scale_dtype: str
    base_scales: np.ndarray
    scales: np.ndarray


def stored_scales(
    fresh: np.ndarray, same: np.ndarray, base_scales: np.ndarray, scale_dtype: str
) -> np.ndarray:
    """The scale bytes of requantized blocks: `fresh` (float32, already representable in
    `scale_dtype`) stored in `scale_dtype`, and the base's where the block is `same`."""
    itemsize = 4 if scale_dtype == "F32" else 2
    stored = scale_bytes(fresh, scale_dtype).reshape(-1, itemsize).copy()
    unchanged = same.astype(bool)
    stored[unchanged] = base_scales.reshape(-1, itemsize)[unchanged]
    return stored.reshape(-1)


def scale_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Scale bytes (F32, or BF16 as stored) as float32 values."""
    if dtype == "F32":
        return raw.view(np.float32)
    if dtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"scale dtype {dtype} is neither F32 nor BF16")


def scale_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 scales stored as `dtype` (F32 as is, BF16 rounded to nearest even), as bytes."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return values.view(np.uint8)
    bits = values.view(np.uint32)
    nan = np.isnan(values)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # a quiet NaN stays NaN
    return rounded.view(np.uint8)


def _numba() -> Any:
    """The numba kernels (`fp8_numba`), or None where numba is not installed: the numpy
    rule here gives the same bytes."""
    from ram_dist.kernels import numba_module

    return numba_module("fp8_numba")


def dequantize(
    q: np.ndarray,
    scales: np.ndarray,
    cols: int,
    block: tuple[int, int],
    out: np.ndarray,
    fast: bool = True,
) -> np.ndarray:
    """`out[i, j] = float32(q[i, j]) * scales[i // bm, j // bn]` for whole rows: `q` holds
    rows of `cols` e4m3fn bytes that start on a band (row 0 of `q` is a band's first row),
    `scales` the float32 scale rows of those bands. Returns `out` (flat float32). `fast`:
    the numba kernel where numba is installed (the same bytes)."""
    bm, bn = block
    kernels = _numba() if fast else None
    if kernels is not None:
        return kernels.dequantize(q, np.ascontiguousarray(scales), cols, bm, bn, E4M3_VALUES, out)
    rows = q.size // cols
    per_element = np.repeat(scales.reshape(-1, -(-cols // bn)), bn, axis=1)[:, :cols]
    x = out.reshape(rows, cols)
    np.take(E4M3_VALUES, q.reshape(rows, cols), out=x)
    x *= np.repeat(per_element, bm, axis=0)[:rows]
    return out


def to_e4m3(values: np.ndarray) -> np.ndarray:
    """The nearest e4m3fn code of each float32 value: ties to even, saturated to +-448, NaN
    to NaN (0x7F with the sign)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = np.abs(values)
    # Normal range [2**-6, 448): keep 3 mantissa bits of the float32, rounded to nearest
    # even, and rebias the exponent (127 -> 7); a carry moves into the exponent as it must.
    magbits = mag.view(np.uint32)
    rounded = (magbits + np.uint32(0x7FFFF) + ((magbits >> 20) & 1)) >> 20
    normal = (rounded.astype(np.int64) - ((127 - 7) << 3)).clip(0, 0x7E)
    # Below 2**-6: multiples of 2**-9 (code 8 is 2**-6, the first normal: codes run on).
    small = np.rint(np.fmin(mag, np.float32(1.0)) * np.float32(512.0)).astype(np.int64)
    code = np.where(mag < np.float32(2.0**-6), small, normal)
    code = np.where(mag >= E4M3_MAX, 0x7E, code)
    code = np.where(np.isnan(values), 0x7F, code)
    return code.astype(np.uint8) | sign


def requantize(
    y: np.ndarray,
    base_x: np.ndarray,
    base_q: np.ndarray,
    base_scales: np.ndarray,
    cols: int,
    block: tuple[int, int],
    scale_dtype: str,
    q_out: np.ndarray | None,
    fast: bool = True,
) -> np.ndarray:
    """The FP8 output of whole bands: `y` the merged float32 values (flat, rows of `cols`),
    `base_x`, `base_q` and `base_scales` the base's values, e4m3fn bytes and raw scale bytes
    (in `scale_dtype`) of the same bands. Writes the e4m3fn bytes into `q_out` (when given)
    and returns the scale rows' bytes, in `scale_dtype`.

    A block whose `y` equals `base_x` bit for bit keeps the base's bytes and scale; any
    other gets `s = amax / 448` (1 where amax is 0), stored in `scale_dtype`, and
    `e4m3fn(y / float32(stored s))`. `fast`: the numba kernels where numba is installed."""
    bm, bn = block
    rows = y.size // cols
    bands, blocks = -(-rows // bm), -(-cols // bn)
    kernels = _numba() if fast else None
    if kernels is not None:
        amax = np.empty(bands * blocks, dtype=np.float32)
        same = np.empty(bands * blocks, dtype=np.uint8)
        kernels.block_stats(y, base_x, cols, bm, bn, amax, same)
    else:
        amax, same = _block_stats(y, base_x, rows, cols, block)
    unchanged = same.astype(bool)
    fresh = np.where(amax == 0, np.float32(1.0), amax / E4M3_MAX).astype(np.float32)
    stored = stored_scales(fresh, same, base_scales, scale_dtype)
    if q_out is None:
        return stored
    divisor = np.ascontiguousarray(scale_values(stored, scale_dtype))
    if kernels is not None:
        kernels.encode(y, divisor, same, base_q, cols, bm, bn, q_out)
        return stored
    s = divisor.reshape(bands, blocks)
    per_element = np.repeat(np.repeat(s, bm, axis=0)[:rows], bn, axis=1)[:, :cols]
    codes = to_e4m3(y.reshape(rows, cols) / per_element)
    flags = unchanged.reshape(bands, blocks)
    keep = np.repeat(np.repeat(flags, bm, axis=0)[:rows], bn, axis=1)[:, :cols]
    q_out.reshape(rows, cols)[:] = np.where(keep, base_q.reshape(rows, cols), codes)
    return stored


def _block_stats(
    y: np.ndarray, base_x: np.ndarray, rows: int, cols: int, block: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Per block, flat: max |y| (NaN where any y is) and 1 where y is base_x bit for bit."""
    bm, bn = block
    bands, blocks = -(-rows // bm), -(-cols // bn)
    pad = ((0, bands * bm - rows), (0, blocks * bn - cols))
    yy = y.reshape(rows, cols)
    equal = (yy.view(np.uint32) == base_x.reshape(rows, cols).view(np.uint32)).astype(np.uint8)
    equal = np.pad(equal, pad, constant_values=1)
    same = equal.reshape(bands, bm, blocks, bn).min(axis=(1, 3)).reshape(-1)
    mags = np.pad(np.abs(yy), pad)
    amax = mags.reshape(bands, bm, blocks, bn).max(axis=(1, 3)).reshape(-1)
    return amax, same


#: Elements of the base's values `requantize_stored` makes at a time (at least one band).
BAND_GROUP = 1 << 18


def requantize_stored(
    y: np.ndarray,
    base_q: np.ndarray,
    base_scales: np.ndarray,
    cols: int,
    block: tuple[int, int],
    scale_dtype: str,
    rounded_to: str,
    q_out: np.ndarray | None,
    scratch: np.ndarray,
) -> np.ndarray:
    """`requantize` of whole bands, with the base's values made from its stored e4m3 bytes
    and raw scale bytes a few bands at a time (about `BAND_GROUP` elements, at least one
    band) into `scratch` (float32, as long as that), rather than from a float32 copy of all
    of them: a method whose kernels read the base as stored then never has it decoded.
    `rounded_to` is the dtype each base value is rounded to after its multiplication
    (compressed-tensors' FP8 with a bf16 scale; "" for none): its values, widened back to
    float32 exactly, are what `y` is compared with. The same bytes as `requantize` given the
    base's values."""
    bm, bn = block
    band = bm * cols
    per = -(-cols // bn) * (4 if scale_dtype == "F32" else 2)  # scale bytes a band
    step = max(1, BAND_GROUP // band) * band
    stored = []
    for lo in range(0, y.size, step):
        hi = min(lo + step, y.size)
        first, last = lo // band, -(-hi // band)
        raw = base_scales[first * per : last * per]
        scales = scale_values(raw, scale_dtype)
        x = dequantize(base_q[lo:hi], scales, cols, block, scratch[: hi - lo])
        if rounded_to:
            x[:] = _widened(x, rounded_to)
        out = None if q_out is None else q_out[lo:hi]
        stored.append(requantize(y[lo:hi], x, base_q[lo:hi], raw, cols, block, scale_dtype, out))
    return np.concatenate(stored) if stored else np.empty(0, np.uint8)


def _widened(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `x` rounded to nearest even to `dtype` (BF16 or F16), as float32 again."""
    if dtype == "BF16":
        return scale_values(scale_bytes(x, "BF16"), "BF16")
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)
