"""Numeric primitives the fused kernels share (numba): the tile loader and storer, the exact
conversions between the stored dtypes and float32 bits, the compile options, and the check
that compiled code has no fused multiply-add.

A kernel works on tiles of `TILE` elements: `load_tile` widens every input into float32 bits
(each by its own dtype's loop, picked at compile time; an FP8 or quantized input's values
computed from its codes and scales, `load_span`), the rule runs in float32, and
`store` narrows the result into the output's dtype. numba has no float16 or bfloat16 arrays,
so both come as raw bits (`NUMBA_ARRAYS`): bfloat16 as uint16, float16 as int16.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import literal_unroll, types
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic, overload, register_jitable

from ram_dist.kernels.quantized import FIELDS as QUANTIZED_FIELDS

#: Elements per tile: the float32 scratch of base and tasks plus four work rows stay in L2.
TILE = 4096
#: Sub-histograms, so that consecutive increments of one bin do not wait on each other.
LANES = 4

#: fastmath off (no FMA contraction, IEEE NaN/inf/subnormal semantics); numpy error model
#: (x / 0 is inf or NaN, as in torch, instead of an exception); no GIL held.
OPTIONS = {"fastmath": False, "nogil": True, "error_model": "numpy"}

#: The array a kernel takes for each numpy view of stored elements that `load` and `store`
#: handle: float16 as its int16 bits (numba has no float16); the others as they are.
NUMBA_ARRAYS = {np.dtype(np.float16): np.dtype(np.int16)}

_U32 = np.uint32
ABS32 = _U32(0x7FFFFFFF)
INF32 = _U32(0x7F800000)
_QNAN32 = _U32(0x7FC00000)
_TWO_M24 = np.float32(2.0**-24)


# ---- bit casts -------------------------------------------------------------------------


@intrinsic
def bits(typingctx: Any, value: Any) -> tuple[Any, Any]:
    """Reinterpret a float32 as its uint32 bits."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def float32_of(typingctx: Any, value: Any) -> tuple[Any, Any]:
    """Reinterpret uint32 bits as a float32."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


# ---- exact conversions (stored dtype <-> float32 bits) ---------------------------------


# Written without early returns: every candidate is computed and one is selected, so that
# LLVM turns the choice into blends and vectorizes the conversion loops.


@register_jitable
def half_to_float_bits(h: int) -> int:
    """fp16 bits -> float32 bits, exact; NaNs keep sign and payload and become quiet (what
    torch's vectorized conversion, F16C, does)."""
    h = _U32(h) & _U32(0xFFFF)
    sign = (h & _U32(0x8000)) << _U32(16)
    e = (h >> _U32(10)) & _U32(0x1F)
    m = h & _U32(0x3FF)
    special = (INF32 if m == _U32(0) else _QNAN32) | (m << _U32(13))
    normal = ((e + _U32(112)) << _U32(23)) | (m << _U32(13))
    # Subnormal (or zero): m * 2**-24 is exact in float32 (m < 2**10, result normal).
    subnormal = bits(np.float32(m) * _TWO_M24)
    return sign | (special if e == _U32(0x1F) else (normal if e != _U32(0) else subnormal))


@register_jitable
def float_bits_to_half(u: int) -> int:
    """float32 bits -> fp16 bits, round to nearest even; overflow gives inf; a NaN keeps
    its sign and top payload bits and becomes quiet (x86 F16C, which torch matches)."""
    u = _U32(u)
    sign = (u >> _U32(16)) & _U32(0x8000)
    a = u & ABS32
    nan = _U32(0x7E00) | ((a >> _U32(13)) & _U32(0x3FF))
    # Normal half (2**-14 <= a < 65520): rebias the exponent, round 13 bits away.
    lsb = (a >> _U32(13)) & _U32(1)
    normal = (a - _U32(0x38000000) + _U32(0xFFF) + lsb) >> _U32(13)
    # Subnormal half (a < 2**-14): round mant * 2**(e - 126 - 23) to a multiple of 2**-24;
    # shifts past 25 (a < 2**-26, or float32 subnormals) all give 0, like 25.
    shift = min(max(np.int64(126) - np.int64(a >> _U32(23)), np.int64(14)), np.int64(25))
    mant = (a & _U32(0x7FFFFF)) | _U32(0x800000)
    q = mant >> _U32(shift)
    rem = mant & ((_U32(1) << _U32(shift)) - _U32(1))
    half = _U32(1) << _U32(shift - 1)
    up = rem > half or (rem == half and (q & _U32(1)) == _U32(1))
    subnormal = q + (_U32(1) if up else _U32(0))
    if a > INF32:
        r = nan
    elif a >= _U32(0x477FF000):  # 65520 and up: the tie above 65504 (odd) rounds to inf
        r = _U32(0x7C00)
    elif a >= _U32(0x38800000):
        r = normal
    else:
        r = subnormal
    return sign | r


@register_jitable
def float_bits_to_bf16(u: int, nan_bits: int) -> int:
    """float32 bits -> bf16 bits, round to nearest even (overflow gives inf). A NaN becomes
    `nan_bits` when >= 0, else keeps sign and top payload bits, made quiet."""
    u = _U32(u)
    nan = _U32(nan_bits) if nan_bits >= 0 else (u >> _U32(16)) | _U32(0x40)
    rounded = (u + _U32(0x7FFF) + ((u >> _U32(16)) & _U32(1))) >> _U32(16)
    return nan if (u & ABS32) > INF32 else rounded


@register_jitable
def e4m3_code(v: int) -> int:
    """float32 bits -> the nearest e4m3fn code: ties to even, saturated to +-448, NaN to NaN
    (0x7F with the sign). Branch-free uint32 arithmetic, so that the loops calling it
    vectorize."""
    v = _U32(v)
    mag = v & ABS32
    # normal range [2**-6, 448): keep 3 mantissa bits, rounded to nearest even; rebias the
    # exponent (127 -> 7, 960 = 120 << 3); a carry moves into the exponent as it must
    normal = ((mag + _U32(0x7FFFF) + ((mag >> _U32(20)) & _U32(1))) >> _U32(20)) - _U32(960)
    # below 2**-6: multiples of 2**-9, |q| * 512 exact and below 8 (ties to even)
    a = abs(float32_of(mag))
    a = a if a < np.float32(1.0) else np.float32(1.0)  # NaN too: never chosen
    small = _U32(np.rint(a * np.float32(512.0)))
    code = normal if mag >= _MIN_NORMAL32 else small
    code = _U32(0x7E) if mag >= _E4M3_MAX32 else code
    code = _U32(0x7F) if mag > INF32 else code
    return code | ((v >> _U32(24)) & _U32(0x80))


_MIN_NORMAL32 = _U32(0x3C800000)  # 2**-6, e4m3fn's smallest normal value
_E4M3_MAX32 = _U32(0x43E00000)  # 448.0, e4m3fn's largest finite value


# ---- tile loads and stores -------------------------------------------------------------


def load(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[:] = float32 bits of src[:] (implemented per dtype below). Callers pass tile
    slices: indices that start at 0 let LLVM drop the negative-index check and vectorize."""
    raise NotImplementedError


# (numba requires an overload's implementation to declare its parameters exactly as the
# typing function does, annotations included: both say Any, numba types vs arrays.)
@overload(load, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_impl(src: Any, dst: Any) -> Callable[..., None] | None:
    if src.dtype == types.float32:

        def load_f32(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = bits(src[i])

        return load_f32
    if src.dtype == types.uint16:

        def load_bf16(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = _U32(src[i]) << _U32(16)

        return load_bf16
    if src.dtype == types.int16:

        def load_f16(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = half_to_float_bits(_U32(src[i]))

        return load_f16
    return None


def store(res: np.ndarray, out: np.ndarray, nan_bits: int) -> None:
    """out[:] = res[:] cast to out's dtype (implemented per dtype below; tile slices)."""
    raise NotImplementedError


@overload(store, jit_options={"fastmath": False, "error_model": "numpy"})
def _store_impl(res: Any, out: Any, nan_bits: Any) -> Callable[..., None] | None:
    if out.dtype == types.float32:

        def store_f32(res: Any, out: Any, nan_bits: Any) -> None:
            for i in range(out.size):
                out[i] = res[i]

        return store_f32
    if out.dtype == types.float64:

        def store_f64(res: Any, out: Any, nan_bits: Any) -> None:
            for i in range(out.size):
                out[i] = np.float64(res[i])

        return store_f64
    if out.dtype == types.uint16:

        def store_bf16(res: Any, out: Any, nan_bits: Any) -> None:
            for i in range(out.size):
                out[i] = float_bits_to_bf16(bits(res[i]), nan_bits)

        return store_bf16
    if out.dtype == types.int16:

        def store_f16(res: Any, out: Any, nan_bits: Any) -> None:
            for i in range(out.size):
                out[i] = float_bits_to_half(bits(res[i]))

        return store_f16
    return None


def is_quantized(src: Any) -> bool:
    """Whether a kernel argument's numba type is a quantized input's tuple (MXFP4 or packed
    INT, `quantized.kernel_tuple`), at compile time."""
    return isinstance(src, types.BaseTuple) and len(src) == QUANTIZED_FIELDS


def values_type(src: Any) -> Any:
    """The numba dtype of an input's values as the kernels see them, at compile time: a
    stored array's own, an FP8 input's float32, a quantized input's its marker's (bfloat16
    as uint16, float16 as int16, float32)."""
    if isinstance(src, types.Array):
        return src.dtype
    if is_quantized(src):
        return src[0].dtype
    return types.float32


def load_span(src: Any, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of elements [lo, lo + m) of an input: a stored array, an FP8
    input's tuple, or a quantized input's (MXFP4 or packed INT: `quantized_spans`)
    (implemented per kind below)."""
    raise NotImplementedError


@overload(load_span, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_span_impl(src: Any, lo: Any, m: Any, dst: Any) -> Callable[..., None] | None:
    if isinstance(src, types.Array):

        def load_array(src: Any, lo: Any, m: Any, dst: Any) -> None:
            load(src[lo : lo + m], dst[:m])

        return load_array
    if is_quantized(src):
        from ram_dist.kernels.quantized_spans import load_mxfp4, load_rows

        def load_quantized(src: Any, lo: Any, m: Any, dst: Any) -> None:
            if src[4] == 0:  # quantized.MXFP4
                load_mxfp4(src, lo, m, dst)
            else:
                load_rows(src, lo, m, dst)

        return load_quantized
    if isinstance(src, types.BaseTuple):

        def load_fp8(src: Any, lo: Any, m: Any, dst: Any) -> None:
            # runs of one row within one block share a scale: one multiplication each
            q, scales, cols, bm, bn = src
            per = (cols + bn - 1) // bn
            row = lo // cols
            col = lo - row * cols
            block = col // bn
            done = 0
            while done < m:
                run = min(m - done, min(block * bn + bn, cols) - col)
                s = scales[(row // bm) * per + block]
                codes = q[lo + done : lo + done + run]
                out = dst[done : done + run]
                for i in range(run):
                    out[i] = bits(float32_of(e4m3_bits(codes[i])) * s)
                done += run
                col += run
                block += 1
                if col == cols:
                    row, col, block = row + 1, 0, 0

        return load_fp8
    return None


@register_jitable
def e4m3_bits(code: int) -> int:
    """e4m3fn code -> float32 bits of its value, exact: `fp8.E4M3_VALUES[code]`, the
    256-entry table, computed rather than looked up (a lookup is a gather, slow or not
    vectorized on many CPUs). The code's 7 magnitude bits placed at a float32's exponent and
    top mantissa bits are the value times 2**-120, exactly (an e4m3 subnormal becomes a
    float32 subnormal, as the kernels' IEEE arithmetic, without flush-to-zero, keeps it), so
    one multiplication by 2**120 (exact) gives the value; then the sign; 0x7F and 0xFF are
    the table's NaN (0x7FC00000)."""
    c = _U32(code)
    mag = c & _U32(0x7F)
    value = bits(float32_of(mag << _U32(20)) * _TWO_120) | ((c & _U32(0x80)) << _U32(24))
    return _QNAN32 if mag == _U32(0x7F) else value


_TWO_120 = np.float32(2.0**120)


def size_of(src: Any) -> int:
    """Elements of an input: a stored array's, an FP8 input's e4m3 bytes', a quantized
    input's values'."""
    raise NotImplementedError


@overload(size_of)
def _size_of_impl(src: Any) -> Callable[..., int] | None:
    if isinstance(src, types.Array):

        def array_size(src: Any) -> int:
            return src.size

        return array_size
    if is_quantized(src):

        def quantized_size(src: Any) -> int:
            return src[9]

        return quantized_size
    if isinstance(src, types.BaseTuple):

        def fp8_size(src: Any) -> int:
            return src[0].size

        return fp8_size
    return None


@register_jitable
def load_tile(inputs: tuple[Any, ...], lo: int, m: int, buf: np.ndarray, at: int = 0) -> None:
    """buf[j, at : at + m] = float32 bits of inputs[j]'s elements [lo, lo + m), for every
    input (the tile every kernel works on; each input is widened by its own kind's loop)."""
    j = 0
    for src in literal_unroll(inputs):
        load_span(src, lo, m, buf[j, at : at + m])
        j += 1


# ---- the base at a task's precision (`kernels.precision`) --------------------------------


def narrows(base: Any, task: Any) -> bool:
    """Whether a task input measures its update against the base rounded to its dtype (its
    values are bfloat16 or float16 and the base's are not; `values_type`): a constant of the
    two inputs' types."""
    raise NotImplementedError


@overload(narrows)
def _narrows_impl(base: Any, task: Any) -> Callable[..., bool]:
    rounded = values_type(task) in (types.uint16, types.int16)
    same = rounded and values_type(base) == values_type(task)
    if rounded and not same:

        def yes(base: Any, task: Any) -> bool:
            return True

        return yes

    def no(base: Any, task: Any) -> bool:
        return False

    return no


def round_bits(task: Any, src: np.ndarray, dst: np.ndarray) -> None:
    """dst[:] = float32 bits of src[:] (float32 bits) rounded to nearest even to the task
    input's dtype (bfloat16 or float16) and widened back: `cast(x_B, p_t)`, exact; an
    overflow gives inf, a NaN stays a quiet NaN (implemented per dtype below)."""
    raise NotImplementedError


@overload(round_bits, jit_options={"fastmath": False, "error_model": "numpy"})
def _round_bits_impl(task: Any, src: Any, dst: Any) -> Callable[..., None] | None:
    if values_type(task) == types.uint16:

        def to_bf16(task: Any, src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = _U32(float_bits_to_bf16(src[i], -1)) << _U32(16)

        return to_bf16
    if values_type(task) == types.int16:

        def to_f16(task: Any, src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = half_to_float_bits(float_bits_to_half(src[i]))

        return to_f16

    def untouched(task: Any, src: Any, dst: Any) -> None:
        return None

    return untouched


@register_jitable
def base_rows(inputs: tuple[Any, ...]) -> np.ndarray:
    """Per task t (0-based), the row of a `load_tile_bases` tile that holds the base at its
    precision: 0 (the base's own row) or `ntasks + 1 + t`."""
    ntasks = len(inputs) - 1
    rows = np.zeros(ntasks, np.int64)
    j = 0
    for src in literal_unroll(inputs):
        if j > 0 and narrows(inputs[0], src):
            rows[j - 1] = ntasks + j
        j += 1
    return rows


@register_jitable
def load_tile_bases(inputs: tuple[Any, ...], lo: int, m: int, buf: np.ndarray) -> None:
    """`load_tile`, and, for each task t that measures against the base rounded to its dtype,
    row `ntasks + 1 + t` of `buf` (which has `2 * ntasks + 1` rows) = the base's row rounded
    to it (`base_rows` says which row each task's update is measured against)."""
    load_tile(inputs, lo, m, buf)
    ntasks = len(inputs) - 1
    j = 0
    for src in literal_unroll(inputs):
        if j > 0 and narrows(inputs[0], src):
            round_bits(src, buf[0, :m], buf[ntasks + j, :m])
        j += 1


# ---- no fused multiply-add -------------------------------------------------------------

_FMA_ASM = re.compile(r"\bv?f(?:n?)m(?:add|sub)\w*", re.IGNORECASE)
_FMA_IR = re.compile(
    r"@llvm\.(?:fma|fmuladd)\b|\bf(?:add|sub|mul)\s+(?:[a-z]+\s+)*(?:contract|fast)\b"
)


def fma_findings(dispatcher: Dispatcher) -> list[str]:
    """Fused multiply-adds in a dispatcher's compiled code (compiled here, not loaded from
    the disk cache, which cannot be inspected): FMA instructions in the assembly, and
    `llvm.fma`/`llvm.fmuladd` calls or `contract`/`fast` flags in the LLVM IR."""
    found: list[str] = []
    for text in dispatcher.inspect_llvm().values():
        found += [m.group(0) for m in _FMA_IR.finditer(text)]
    for text in dispatcher.inspect_asm().values():
        found += [m.group(0) for m in _FMA_ASM.finditer(text)]
    return found
