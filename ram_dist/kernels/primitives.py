"""Numeric primitives the fused kernels share (numba): the tile loader and storer, the exact
conversions between the stored dtypes and float32 bits, and the compile options (no
fastmath: `fma_check` inspects the compiled code for fused multiply-adds).

A kernel works on tiles of `TILE` elements: `load_tile` widens every input into float32 bits
(each by its own dtype's loop, picked once a span from the input's record, `load_span`; an
FP8 or quantized input's values computed from its codes and scales), the rule runs in
float32, and `store_span` narrows the result into the output's dtype. The inputs and the
output come as records (int64: kind, size, arrays' addresses, parameters; `views`), so a
kernel has one numba type whatever the dtypes, formats and task count, and compiles once.
numba has no float16 or bfloat16 arrays, so both are read as raw bits (`NUMBA_ARRAYS`):
bfloat16 as uint16, float16 as int16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import carray, types
from numba.extending import intrinsic, overload, register_jitable

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


def _bitcast(name: str, source: Any, target: Any, doc: str) -> Any:
    """An intrinsic that reinterprets a `source` value's bits as a `target` (same width):
    one LLVM bitcast, no conversion."""

    def typer(typingctx: Any, value: Any) -> tuple[Any, Any]:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], context.get_value_type(target))

        return target(source), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


bits = _bitcast("bits", types.float32, types.uint32, "A float32's uint32 bits.")
float32_of = _bitcast("float32_of", types.uint32, types.float32, "uint32 bits as a float32.")
#: float64 <-> 64-bit integers: unsigned for shifts that must not extend the sign
#: (`exact_sums_numba`), signed for exponent arithmetic (`arcee_numba`'s exp and log).
bits64 = _bitcast("bits64", types.float64, types.uint64, "A float64's uint64 bits.")
int_bits64 = _bitcast("int_bits64", types.float64, types.int64, "A float64's bits, as int64.")
float64_of = _bitcast("float64_of", types.int64, types.float64, "int64 bits as a float64.")


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


# ---- inputs and outputs as records (one kernel type whatever their dtypes and count) -------
#
# `views.kernel_inputs` hands a kernel its inputs as one int64 table, a row (record) per
# input, and `views.kernel_output` its output as one such row: the kind of the stored form,
# its values' dtype, its element count, the addresses and byte counts of its arrays, and the
# quantized formats' parameters. Their numba type is the same for any dtype, format and
# task count, so each kernel compiles once; the loaders below switch on the kind once per
# span and run the same typed loop as before inside each case.

#: Record fields (`KIND`: the stored form; `VALUES`: its values' dtype, as a kind code).
KIND, VALUES, SIZE, DATA, SCALES, ZEROS, PANEL = 0, 1, 2, 3, 5, 7, 9
#: MXFP4's panel key, and the quantized and FP8 forms' parameters (`quantized.QuantizedValues`,
#: `fp8.Fp8Values`'s columns and block).
KEY, FORMAT, BITS, ROWS, COLS, GROUPS, BM, BN = 11, 12, 13, 14, 15, 16, 17, 18
#: Fields of a record; DATA, SCALES, ZEROS and PANEL are each (address, bytes).
FIELDS = 19
#: Kind codes: stored arrays (bfloat16 as uint16 bits, float16 as int16 bits, float32,
#: float64 for outputs), block FP8 (`fp8.Fp8Values`), MXFP4 / packed INT / rounded FP8
#: (`quantized.QuantizedValues`, their values' dtype in `VALUES`).
BF16, F16, F32, F64, FP8, QUANTIZED = 0, 1, 2, 3, 4, 5


@intrinsic
def _pointer(typingctx: Any, address: Any) -> tuple[Any, Any]:
    """An int64 address as a byte pointer (`carray` makes it an array)."""
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return sig, codegen


@register_jitable
def field_bytes(rec: np.ndarray, at: int) -> np.ndarray:
    """The bytes of a record's array field `at` (its address and byte count), as uint8;
    `.view` gives its typed elements (the caller keeps the array alive: `views`)."""
    return carray(_pointer(rec[at]), rec[at + 1])


@register_jitable
def load_span(src: np.ndarray, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of elements [lo, lo + m) of an input record: a stored array
    (`load`'s loop for its dtype), an FP8 input (`load_fp8`), or a quantized one (MXFP4 or
    packed INT: `quantized_spans`). One switch per span."""
    kind = src[KIND]
    if kind == BF16:
        load(field_bytes(src, DATA).view(np.uint16)[lo : lo + m], dst[:m])
    elif kind == F16:
        load(field_bytes(src, DATA).view(np.int16)[lo : lo + m], dst[:m])
    elif kind == F32:
        load(field_bytes(src, DATA).view(np.float32)[lo : lo + m], dst[:m])
    elif kind == FP8:
        load_fp8(src, lo, m, dst)
    else:
        load_quantized(src, lo, m, dst)


def load_quantized(src: np.ndarray, lo: int, m: int, dst: np.ndarray) -> None:
    """`quantized_spans`' loaders (imported when first compiled: that module imports this
    one)."""
    raise NotImplementedError


@overload(load_quantized, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_quantized_impl(src: Any, lo: Any, m: Any, dst: Any) -> Callable[..., None]:
    from ram_dist.kernels.quantized_spans import load_mxfp4, load_rows

    def impl(src: Any, lo: Any, m: Any, dst: Any) -> None:
        if src[FORMAT] == 0:  # quantized.MXFP4
            load_mxfp4(src, lo, m, dst)
        else:
            load_rows(src, lo, m, dst)

    return impl


@register_jitable
def load_fp8(src: np.ndarray, lo: int, m: int, dst: np.ndarray) -> None:
    """dst[:m] = float32 bits of an FP8 input's elements [lo, lo + m): runs of one row
    within one block share a scale, one multiplication each."""
    q = field_bytes(src, DATA)
    scales = field_bytes(src, SCALES).view(np.float32)
    cols, bm, bn = src[COLS], src[BM], src[BN]
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


@register_jitable
def store_span(res: np.ndarray, out: np.ndarray, lo: int, nan_bits: int) -> None:
    """Elements [lo, lo + res.size) of an output record = res (float32) cast to its dtype
    (`store`'s loop for it). One switch per span."""
    m = res.size
    kind = out[KIND]
    if kind == BF16:
        store(res, field_bytes(out, DATA).view(np.uint16)[lo : lo + m], nan_bits)
    elif kind == F16:
        store(res, field_bytes(out, DATA).view(np.int16)[lo : lo + m], nan_bits)
    elif kind == F32:
        store(res, field_bytes(out, DATA).view(np.float32)[lo : lo + m], nan_bits)
    else:
        store(res, field_bytes(out, DATA).view(np.float64)[lo : lo + m], nan_bits)


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


@register_jitable
def size_of(src: np.ndarray) -> int:
    """Elements of an input record: a stored array's, an FP8 input's e4m3 bytes', a
    quantized input's values'."""
    return src[SIZE]


@register_jitable
def load_tile(inputs: np.ndarray, lo: int, m: int, buf: np.ndarray, at: int = 0) -> None:
    """buf[j, at : at + m] = float32 bits of input j's elements [lo, lo + m), for every
    record of `inputs` (the tile every kernel works on; each input is widened by its own
    kind's loop)."""
    for j in range(inputs.shape[0]):
        load_span(inputs[j], lo, m, buf[j, at : at + m])


# ---- the base at a task's precision (`kernels.precision`) --------------------------------


@register_jitable
def narrows(base: np.ndarray, task: np.ndarray) -> bool:
    """Whether a task input measures its update against the base rounded to its dtype (its
    values are bfloat16 or float16 and the base's are not), from the two records."""
    t = task[VALUES]
    return (t == BF16 or t == F16) and base[VALUES] != t


@register_jitable
def round_bits(values: int, src: np.ndarray, dst: np.ndarray) -> None:
    """dst[:] = float32 bits of src[:] (float32 bits) rounded to nearest even to `values`
    (a kind code: bfloat16 or float16; float32 copies) and widened back: `cast(x_B, p_t)`,
    exact; an overflow gives inf, a NaN stays a quiet NaN. One switch per span."""
    if values == BF16:
        for i in range(dst.size):
            dst[i] = _U32(float_bits_to_bf16(src[i], -1)) << _U32(16)
    elif values == F16:
        for i in range(dst.size):
            dst[i] = half_to_float_bits(float_bits_to_half(src[i]))
    else:
        for i in range(dst.size):
            dst[i] = src[i]


@register_jitable
def base_rows(inputs: np.ndarray) -> np.ndarray:
    """Per task t (0-based), the row of a `load_tile_bases` tile that holds the base at its
    precision: 0 (the base's own row) or `ntasks + 1 + t`."""
    ntasks = inputs.shape[0] - 1
    rows = np.zeros(ntasks, np.int64)
    for j in range(1, ntasks + 1):
        if narrows(inputs[0], inputs[j]):
            rows[j - 1] = ntasks + j
    return rows


@register_jitable
def tiles_of(inputs: np.ndarray, width: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The elements of `inputs` and a `load_tile_bases` tile of `width` for them: its uint32
    rows (base, tasks, the base at each narrower task's precision), their float32 view, and
    `base_rows` (the prologue of every kernel that reads tiles of a merge's inputs)."""
    buf = np.empty((2 * inputs.shape[0] - 1, width), np.uint32)
    return size_of(inputs[0]), buf, buf.view(np.float32), base_rows(inputs)


@register_jitable
def load_tile_bases(inputs: np.ndarray, lo: int, m: int, buf: np.ndarray) -> None:
    """`load_tile`, and, for each task t that measures against the base rounded to its dtype,
    row `ntasks + 1 + t` of `buf` (which has `2 * ntasks + 1` rows) = the base's row rounded
    to it (`base_rows` says which row each task's update is measured against)."""
    load_tile(inputs, lo, m, buf)
    ntasks = inputs.shape[0] - 1
    for j in range(1, ntasks + 1):
        if narrows(inputs[0], inputs[j]):
            round_bits(inputs[j, VALUES], buf[0, :m], buf[ntasks + j, :m])


@register_jitable
def task_vectors(vals: np.ndarray, rows: np.ndarray, m: int) -> None:
    """vals[t + 1, :m] -= the base at task t's precision (row `rows[t]`), in place: each
    task's row of a `load_tile_bases` tile becomes its task vector."""
    for t in range(rows.size):
        x = vals[t + 1]
        base = vals[rows[t]]
        for i in range(m):
            x[i] = x[i] - base[i]


@register_jitable
def count_nonfinite(buf: np.ndarray, m: int, counts: np.ndarray) -> None:
    """counts[j] += how many of the first `m` float32 bits in row j of `buf` are NaN or Inf,
    for each of counts' rows (a tile's inputs, base first)."""
    for j in range(counts.size):
        row = buf[j, :m]
        found = 0
        for i in range(m):
            found += 1 if (row[i] & INF32) == INF32 else 0
        counts[j] += found
