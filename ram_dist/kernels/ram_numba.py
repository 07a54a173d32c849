"""Fused CPU kernels (numba) for RAM's two passes, byte-identical to the eager torch path.

`overlap_counts` is `ram_dist.methods.ram.overlap_statistics` and `merge_ram` is
`ram_dist.methods.ram.merge_ram(...).to(out_dtype)`, computed in one sweep over the inputs
instead of a dozen full-size torch temporaries: single-threaded, the eager path costs 70 to
110 ns per element and pass, these kernels about 2 (bf16 base + 3 tasks, 16M elements; see
`benchmarks/bench_kernels.py`), a few times the cost of merely streaming the bytes.

Design (measured):
- Inputs keep their stored dtype (float32, bfloat16 or float16, mixed freely: each
  checkpoint has its own). A kernel walks the chunk in tiles of `TILE` elements. Per tile,
  each input is widened to float32 bits in an [N+1, TILE] scratch buffer by an exact
  conversion loop picked by its dtype at compile time (`literal_unroll` over the tuple of
  inputs: each dtype combination compiles once, then comes from numba's disk cache); the rule
  then runs on the float32 rows task by task, in loops LLVM vectorizes, and the result is
  narrowed into the output dtype. The scratch stays in L2, so each input byte is read once
  from memory and each output byte written once. The alternative, one element loop per dtype
  combination with the tasks unrolled inside, measured 2.3x slower: it does not vectorize.
  Widening whole chunks to float32 first would add 4 bytes of memory traffic per input
  element for nothing.
- Arithmetic is op for op the eager one, in float32: `tau = x_t - b`, `|tau| > float32(eps)`,
  `total = total + where(m, tau, 0)` in task order, `lambda * total` when one task is active,
  `total / float32(c)` otherwise, then `b + merged`; `c == 0` keeps `b`. No fastmath, so LLVM
  never contracts a multiply and an add into an FMA (`fma_instructions` checks the IR and the
  assembly; tests also check values an FMA would change). `error_model="numpy"` lets
  `total / 0` give NaN (as in torch, which then discards it) instead of raising, which the
  division needs to vectorize.
- numba has no float16 or bfloat16 arrays, so the wrappers pass raw bits, tagged by dtype:
  bfloat16 as uint16, float16 as int16; float32 and float64 as such.
- float64 inputs are not handled (the spec computes those tensors in float64): `supports`
  says so, and the caller keeps the eager path for them.
- NaN bytes, where torch is not consistent with itself:
  * float32 -> bfloat16: torch's vectorized cast (AVX2/AVX512) writes 0xFFFF for every NaN,
    its scalar cast (no SIMD, non-contiguous or 0-d tensors) 0x7FC0. `merge_ram` writes what
    torch writes here for a contiguous cast (probed once, `torch_bf16_nan`).
  * float16 -> float32: torch widens 8 at a time with F16C (a NaN stays NaN with its sign and
    payload, made quiet) but the last n % 8 elements of each thread's range with a scalar
    routine that gives 0x7FFFFFFF for every NaN, so its bytes for a NaN from a float16 input
    depend on the position, the chunking and the thread count. These kernels give the F16C
    result everywhere (what torch gives for all but those tail elements).
  Everything else, NaN from inf - inf included, matches torch bit for bit.
- `nogil=True`: a worker may read the next chunk in a thread while this one computes.
  Not `parallel`: Ray supplies the parallelism, one process per core.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import literal_unroll, njit, types
from numba.core.dispatcher import Dispatcher
from numba.extending import intrinsic, overload, register_jitable

from ram_dist.kernels import use_writable_cache

#: Elements per tile: the float32 scratch of base and tasks plus four work rows stay in L2.
TILE = 4096
#: Up to this many tasks, the counting pass keeps a histogram of active-task bit patterns
#: (2**N bins, one increment per element); above it, one increment per active task.
CODE_TASKS = 10
#: Sub-histograms, so that consecutive increments of one bin do not wait on each other.
LANES = 4

if TYPE_CHECKING:
    import torch

#: torch's names of the dtypes the kernels read, and the array each is read as.
_TORCH_TO_KERNEL = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.int16}
_TORCH_OUT_TO_KERNEL = {**_TORCH_TO_KERNEL, "float64": np.float64}

_U32 = np.uint32
_ABS32 = _U32(0x7FFFFFFF)
_INF32 = _U32(0x7F800000)
_QNAN32 = _U32(0x7FC00000)
_TWO_M24 = np.float32(2.0**-24)

#: fastmath off (no FMA contraction, IEEE NaN/inf/subnormal semantics); numpy error model
#: (x / 0 is inf or NaN, as in torch, instead of an exception); no GIL held.
_OPTIONS = {"fastmath": False, "nogil": True, "error_model": "numpy"}

use_writable_cache()  # before the first `@njit(cache=True)` picks numba's cache directory


# ---- bit casts -------------------------------------------------------------------------


@intrinsic
def _bits(typingctx: Any, value: Any) -> tuple[Any, Any]:
    """Reinterpret a float32 as its uint32 bits."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


# ---- exact conversions (stored dtype <-> float32 bits) ---------------------------------


# Written without early returns: every candidate is computed and one is selected, so that
# LLVM turns the choice into blends and vectorizes the conversion loops.


@register_jitable
def _half_to_float_bits(h: int) -> int:
    """fp16 bits -> float32 bits, exact; NaNs keep sign and payload and become quiet (what
    torch's vectorized conversion, F16C, does)."""
    h = _U32(h) & _U32(0xFFFF)
    sign = (h & _U32(0x8000)) << _U32(16)
    e = (h >> _U32(10)) & _U32(0x1F)
    m = h & _U32(0x3FF)
    special = (_INF32 if m == _U32(0) else _QNAN32) | (m << _U32(13))
    normal = ((e + _U32(112)) << _U32(23)) | (m << _U32(13))
    # Subnormal (or zero): m * 2**-24 is exact in float32 (m < 2**10, result normal).
    subnormal = _bits(np.float32(m) * _TWO_M24)
    return sign | (special if e == _U32(0x1F) else (normal if e != _U32(0) else subnormal))


@register_jitable
def _float_bits_to_half(u: int) -> int:
    """float32 bits -> fp16 bits, round to nearest even; overflow gives inf; a NaN keeps
    its sign and top payload bits and becomes quiet (x86 F16C, which torch matches)."""
    u = _U32(u)
    sign = (u >> _U32(16)) & _U32(0x8000)
    a = u & _ABS32
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
    if a > _INF32:
        r = nan
    elif a >= _U32(0x477FF000):  # 65520 and up: the tie above 65504 (odd) rounds to inf
        r = _U32(0x7C00)
    elif a >= _U32(0x38800000):
        r = normal
    else:
        r = subnormal
    return sign | r


@register_jitable
def _float_bits_to_bf16(u: int, nan_bits: int) -> int:
    """float32 bits -> bf16 bits, round to nearest even (overflow gives inf). A NaN becomes
    `nan_bits` when >= 0, else keeps sign and top payload bits, made quiet."""
    u = _U32(u)
    nan = _U32(nan_bits) if nan_bits >= 0 else (u >> _U32(16)) | _U32(0x40)
    rounded = (u + _U32(0x7FFF) + ((u >> _U32(16)) & _U32(1))) >> _U32(16)
    return nan if (u & _ABS32) > _INF32 else rounded


def _load(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[:] = float32 bits of src[:] (implemented per dtype below). Callers pass tile
    slices: indices that start at 0 let LLVM drop the negative-index check and vectorize."""
    raise NotImplementedError


# (numba requires an overload's implementation to declare its parameters exactly as the
# typing function does, annotations included: both say Any, numba types vs arrays.)
@overload(_load, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_impl(src: Any, dst: Any) -> Callable[..., None] | None:
    if src.dtype == types.float32:

        def load_f32(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = _bits(src[i])

        return load_f32
    if src.dtype == types.uint16:

        def load_bf16(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = _U32(src[i]) << _U32(16)

        return load_bf16
    if src.dtype == types.int16:

        def load_f16(src: Any, dst: Any) -> None:
            for i in range(dst.size):
                dst[i] = _half_to_float_bits(_U32(src[i]))

        return load_f16
    return None


def _store(res: np.ndarray, out: np.ndarray, nan_bits: int) -> None:
    """out[:] = res[:] cast to out's dtype (implemented per dtype below; tile slices)."""
    raise NotImplementedError


@overload(_store, jit_options={"fastmath": False, "error_model": "numpy"})
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
                out[i] = _float_bits_to_bf16(_bits(res[i]), nan_bits)

        return store_bf16
    if out.dtype == types.int16:

        def store_f16(res: Any, out: Any, nan_bits: Any) -> None:
            for i in range(out.size):
                out[i] = _float_bits_to_half(_bits(res[i]))

        return store_f16
    return None


# ---- the two passes --------------------------------------------------------------------


@register_jitable
def _load_tile(inputs: tuple[np.ndarray, ...], lo: int, m: int, buf: np.ndarray) -> None:
    """buf[j, :m] = float32 bits of inputs[j][lo : lo + m], for every input (the tile every
    kernel here and in `ties_numba` works on; each input is widened by its own dtype's loop)."""
    j = 0
    for src in literal_unroll(inputs):
        _load(src[lo : lo + m], buf[j, :m])
        j += 1


@njit(cache=True, **_OPTIONS)
def _count_kernel(
    inputs: tuple[np.ndarray, ...],
    eps: np.float32,
    hist: np.ndarray,
    nonfinite: np.ndarray,
    code_tasks: int,
) -> None:
    """hist[:] += overlap statistics of inputs = (base, task_1, ..., task_N); when
    nonfinite has N+1 entries, nonfinite[j] += NaN and Inf count of input j."""
    n = inputs[0].size
    ntasks = len(inputs) - 1
    buf = np.empty((ntasks + 1, TILE), np.uint32)
    vals = buf.view(np.float32)
    base = vals[0]
    code = np.empty(TILE, np.int32)
    small = ntasks <= code_tasks
    patterns = np.zeros((LANES, (1 << ntasks) if small else 1), np.int64)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        _load_tile(inputs, lo, m, buf)
        if nonfinite.size:
            for j in range(ntasks + 1):
                row = buf[j, :m]
                found = 0
                for i in range(m):
                    found += 1 if (row[i] & _INF32) == _INF32 else 0
                nonfinite[j] += found
        for i in range(m):
            code[i] = 0
        if small:  # code = bit pattern of the active tasks
            for t in range(ntasks):
                x = vals[t + 1]
                bit = np.int32(1 << t)
                for i in range(m):
                    code[i] |= bit if abs(x[i] - base[i]) > eps else np.int32(0)
            for i in range(m):
                patterns[i & (LANES - 1), code[i]] += 1
        else:  # code = c, then one increment per active task
            for t in range(ntasks):
                x = vals[t + 1]
                for i in range(m):
                    code[i] += np.int32(1) if abs(x[i] - base[i]) > eps else np.int32(0)
            for i in range(m):
                hist[ntasks, code[i]] += 1
            for t in range(ntasks):
                x = vals[t + 1]
                for i in range(m):
                    if abs(x[i] - base[i]) > eps:
                        hist[t, code[i]] += 1
    if small:
        for pattern in range(1 << ntasks):
            total = 0
            for lane in range(LANES):
                total += patterns[lane, pattern]
            k = 0
            for t in range(ntasks):
                k += (pattern >> t) & 1
            hist[ntasks, k] += total
            for t in range(ntasks):
                if (pattern >> t) & 1:
                    hist[t, k] += total


@njit(cache=True, **_OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...], eps: np.float32, lam: np.ndarray, out: np.ndarray, nan_bits: int
) -> None:
    """out[:] = RAM merge of inputs = (base, task_1, ..., task_N), cast to out's dtype."""
    n = inputs[0].size
    ntasks = len(inputs) - 1
    buf = np.empty((ntasks + 1, TILE), np.uint32)
    vals = buf.view(np.float32)
    base = vals[0]
    total = np.empty(TILE, np.float32)
    count = np.empty(TILE, np.int32)
    scale = np.empty(TILE, np.float32)
    res = np.empty(TILE, np.float32)
    zero = np.float32(0.0)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        _load_tile(inputs, lo, m, buf)
        for i in range(m):
            total[i] = zero
            count[i] = 0
            scale[i] = zero
        for t in range(ntasks):
            x = vals[t + 1]
            lam_t = lam[t]
            for i in range(m):
                tau = x[i] - base[i]
                active = abs(tau) > eps
                total[i] = total[i] + (tau if active else zero)
                count[i] += np.int32(1) if active else np.int32(0)
                scale[i] = lam_t if active else scale[i]
        for i in range(m):
            c = count[i]
            b = base[i]
            unique = scale[i] * total[i]  # c == 1: total is the one active tau, exactly
            shared = total[i] / np.float32(c)
            merged = unique if c == 1 else shared
            res[i] = b if c == 0 else b + merged
        _store(res[:m], out[lo : lo + m], nan_bits)


# ---- Python API ------------------------------------------------------------------------

ArrayLike = "torch.Tensor | np.ndarray"


def _is_tensor(x: object) -> bool:
    """Whether `x` is a torch tensor, without importing torch (a worker on the fused path
    never does: the engine hands numpy arrays)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


#: The array a kernel reads for each numpy dtype it takes (bf16 comes as its uint16 bits),
#: and writes (float64 too).
_NUMPY_TO_KERNEL = {np.dtype(np.float32): np.float32, np.dtype(np.uint16): np.uint16,
                    np.dtype(np.float16): np.int16}  # fmt: skip
_NUMPY_OUT_TO_KERNEL = {**_NUMPY_TO_KERNEL, np.dtype(np.float64): np.float64}


def _kernel_view(x: ArrayLike, table: dict[str, type], writable: bool) -> np.ndarray:
    """The flat array a kernel reads (or writes), tagged by dtype as the kernels expect."""
    if isinstance(x, np.ndarray):  # the engine's case first: it is called once per block
        kinds = _NUMPY_OUT_TO_KERNEL if table is _TORCH_OUT_TO_KERNEL else _NUMPY_TO_KERNEL
        kind = kinds.get(x.dtype)
        if kind is None:
            raise TypeError(f"fused RAM kernels do not handle numpy {x.dtype} (bf16 is uint16)")
        if writable and not (x.flags.c_contiguous and x.flags.writeable):
            raise ValueError("the output of a fused RAM kernel must be contiguous and writable")
        return x.ravel().view(kind)
    if not _is_tensor(x):
        raise TypeError(f"expected a torch tensor or numpy array, got {type(x).__name__}")
    import torch

    assert isinstance(x, torch.Tensor)
    if x.device.type != "cpu":
        raise TypeError(f"fused RAM kernels run on CPU tensors, got {x.device}")
    name = str(x.dtype).removeprefix("torch.")
    if name not in table:
        raise TypeError(f"fused RAM kernels do not handle {x.dtype}")
    if not x.is_contiguous():
        if writable:
            raise ValueError("the output of a fused RAM kernel must be contiguous")
        x = x.contiguous()
    flat = x.reshape(-1)
    if x.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy().view(table[name])


def _inputs(base: ArrayLike, tasks: Sequence[ArrayLike]) -> tuple[np.ndarray, ...]:
    if len(tasks) < 1:
        raise ValueError("fused RAM kernels need at least one task")
    arrays = (_kernel_view(base, _TORCH_TO_KERNEL, False),)
    arrays += tuple([_kernel_view(x, _TORCH_TO_KERNEL, False) for x in tasks])
    size = arrays[0].size
    if any(a.size != size for a in arrays):
        raise ValueError(f"base and tasks differ in length: {[a.size for a in arrays]}")
    return arrays


def supports(inputs: Sequence[torch.dtype], out: torch.dtype | None = None) -> bool:
    """Whether the fused kernels take these torch input dtypes (and output dtype); float64
    inputs, and anything else, stay on the eager path (`ram_dist.kernels.handle` answers
    the same for safetensors dtype names)."""

    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    ok = all(name(d) in _TORCH_TO_KERNEL for d in inputs)
    return ok and (out is None or name(out) in _TORCH_OUT_TO_KERNEL)


def overlap_counts(
    base: ArrayLike, tasks: Sequence[ArrayLike], eps: float, *, code_tasks: int = CODE_TASKS
) -> np.ndarray:
    """int64 [N+1, N+1], equal to `methods.ram.overlap_statistics(base, tasks, eps)`.

    `code_tasks` picks the counting strategy (both exact; tests force each)."""
    arrays = _inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    _count_kernel(arrays, np.float32(eps), hist, np.zeros(0, np.int64), code_tasks)
    return hist


def overlap_counts_nonfinite(
    base: ArrayLike, tasks: Sequence[ArrayLike], eps: float, *, code_tasks: int = CODE_TASKS
) -> tuple[np.ndarray, list[int]]:
    """`overlap_counts`, plus the NaN and Inf count of every input (base first) from the
    same sweep: the reduce pass's finiteness check without reading the inputs again."""
    arrays = _inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    nonfinite = np.zeros(ntasks + 1, np.int64)
    _count_kernel(arrays, np.float32(eps), hist, nonfinite, code_tasks)
    return hist, nonfinite.tolist()


def merge_ram(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    eps: float,
    lambdas: Sequence[float],
    out: ArrayLike,
    *,
    bf16_nan: int | None = None,
) -> None:
    """Write `methods.ram.merge_ram(base, tasks, eps, lambdas).to(out.dtype)` into `out`.

    `out` is float32, bfloat16, float16 or float64 (a numpy uint16 array means bfloat16), of
    the inputs' length, and must not overlap them. `lambdas` are rounded to float32 once.
    `bf16_nan`: the bits of a NaN cast to bfloat16; by default what torch writes here (the
    engine passes what it probed on the driver, so that workers need no torch)."""
    arrays = _inputs(base, tasks)
    target = _kernel_view(out, _TORCH_OUT_TO_KERNEL, True)
    if target.size != arrays[0].size:
        raise ValueError(f"out has {target.size} elements, the inputs {arrays[0].size}")
    if len(lambdas) != len(arrays) - 1:
        raise ValueError(f"{len(lambdas)} lambdas for {len(arrays) - 1} tasks")
    lam = np.asarray(lambdas, dtype=np.float64).astype(np.float32)
    nan_bits = torch_bf16_nan() if bf16_nan is None else bf16_nan
    _merge_kernel(arrays, np.float32(eps), lam, target, nan_bits)


@functools.cache
def torch_bf16_nan() -> int:
    """What torch writes for a NaN cast to bfloat16 in a contiguous tensor in this process:
    0xFFFF on AVX2/AVX512 builds, 0x7FC0 on the scalar path; -1 when it keeps the sign and
    payload (a quiet NaN, as `vcvtneps2bf16` would)."""
    import torch

    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF], np.uint32)
    probe = torch.from_numpy(np.tile(nans, 13).view(np.float32))
    got = probe.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    values = {int(v) for v in got}
    if len(values) == 1:
        return values.pop()
    if all(int(g) == (int(v) >> 16) | 0x40 for g, v in zip(got, np.tile(nans, 13), strict=True)):
        return -1
    raise RuntimeError(f"unexpected NaN encoding of torch's bfloat16 cast: {sorted(values)}")


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


def fma_instructions() -> list[str]:
    """`fma_findings` of both kernels, compiled afresh (uncached, same options) for every
    signature they have been called with. Must be empty: an FMA rounds once where the spec
    rounds twice."""
    found: list[str] = []
    for kernel in (_count_kernel, _merge_kernel):
        fresh = njit(cache=False, **_OPTIONS)(kernel.py_func)
        for sig in kernel.signatures:
            fresh.compile(sig)
        found += fma_findings(fresh)
    return found
