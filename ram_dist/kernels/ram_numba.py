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
  conversion loop picked by its dtype once per tile (the inputs come as records,
  `views.kernel_inputs`: one signature for every dtype combination and task count, compiled
  once, then loaded from numba's disk cache); the rule
  then runs on the float32 rows task by task, in loops LLVM vectorizes, and the result is
  narrowed into the output dtype. The scratch stays in L2, so each input byte is read once
  from memory and each output byte written once. The alternative, one element loop per dtype
  combination with the tasks unrolled inside, measured 2.3x slower: it does not vectorize.
  Widening whole chunks to float32 first would add 4 bytes of memory traffic per input
  element for nothing.
- FP8 inputs (`fp8.Fp8Values`: e4m3 bytes and block scales) are loaded the same way, each
  value computed as the spec defines it (`primitives.load_span`), so no float32 copy of an
  FP8 input is made; `merge_ram_fp8` writes FP8 output in the same sweep, a band at a time:
  the band's merged float32 values tile by tile (each block's amax, and whether it is the
  base's values bit for bit, gathered while the tile is in cache), then its scales and e4m3
  bytes (`fp8.requantize`'s rule; an unchanged block keeps the base's bytes).
- MXFP4 and packed INT4/INT8 inputs (`quantized.QuantizedValues`: codes and scales as
  stored) are loaded the same way (`quantized_spans`), each value the bits the eager path's
  decoders give (`mxfp4.decode_bf16`, `int_packed.decode_in`), so no copy of their values is
  made either. Their format and values' dtype are fields of their record, not types.
- Arithmetic is op for op the eager one, in float32: `tau = x_t - b`, `|tau| > float32(eps)`,
  `total = total + where(m, tau, 0)` in task order, `lambda * total` when one task is active,
  `total / float32(c)` otherwise, then `b + merged`; `c == 0` keeps `b`. No fastmath, so LLVM
  never contracts a multiply and an add into an FMA (`fma_instructions` checks the machine
  code; tests also check values an FMA would change). `error_model="numpy"` lets
  `total / 0` give NaN (as in torch, which then discards it) instead of raising, which the
  division needs to vectorize.
- numba has no float16 or bfloat16 arrays, so the records hold raw bits, tagged by a kind
  code: bfloat16 read as uint16, float16 as int16; float32 and float64 as such.
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

from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, handle, use_writable_cache
from ram_dist.kernels.fma_check import fma_findings
from ram_dist.kernels.fp8 import Fp8Target, Fp8Values, stored_scales
from ram_dist.kernels.precision_numba import check_inputs, task_tests
from ram_dist.kernels.primitives import (
    LANES,
    OPTIONS,
    TILE,
    bits,
    e4m3_code,
    float32_of,
    float_bits_to_bf16,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, kernel_inputs, kernel_view, merge_records

if TYPE_CHECKING:
    import torch

_U32 = np.uint32

#: Up to this many tasks, the counting pass keeps a histogram of active-task bit patterns
#: (2**N bins, one increment per element); above it, one increment per active task.
CODE_TASKS = 10

use_writable_cache()  # before the first `@njit(cache=True)` picks numba's cache directory


# ---- the two passes --------------------------------------------------------------------


@njit(cache=True, **OPTIONS)
def _count_kernel(
    inputs: tuple[np.ndarray, ...],
    eps: np.float32,
    hist: np.ndarray,
    nonfinite: np.ndarray,
    code_tasks: int,
    checks: np.ndarray,
) -> None:
    """hist[:] += overlap statistics of inputs = (base, task_1, ..., task_N); when
    nonfinite has N+1 entries, nonfinite[j] += NaN and Inf count of input j; when `checks`
    has N rows, checks[t] += the precision check of task t (`precision_numba.check_tile`),
    from the same tiles."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    tests = task_tests(inputs)
    scratch = np.empty((2, TILE), np.uint32)  # the precision check's
    code = np.empty(TILE, np.int32)
    small = ntasks <= code_tasks
    patterns = np.zeros((LANES, (1 << ntasks) if small else 1), np.int64)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        check_inputs(buf, rows, tests, m, eps, nonfinite, checks, scratch)
        for i in range(m):
            code[i] = 0
        if small:  # code = bit pattern of the active tasks
            for t in range(ntasks):
                x = vals[t + 1]
                base = vals[rows[t]]  # the base at task t's precision
                bit = np.int32(1 << t)
                for i in range(m):
                    code[i] |= bit if abs(x[i] - base[i]) > eps else np.int32(0)
            for i in range(m):
                patterns[i & (LANES - 1), code[i]] += 1
        else:  # code = c, then one increment per active task
            for t in range(ntasks):
                x = vals[t + 1]
                base = vals[rows[t]]
                for i in range(m):
                    code[i] += np.int32(1) if abs(x[i] - base[i]) > eps else np.int32(0)
            for i in range(m):
                hist[ntasks, code[i]] += 1
            for t in range(ntasks):
                x = vals[t + 1]
                base = vals[rows[t]]
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


@register_jitable
def _ram_tile(
    vals: np.ndarray,
    rows: np.ndarray,
    m: int,
    eps: np.float32,
    lam: np.ndarray,
    total: np.ndarray,
    count: np.ndarray,
    scale: np.ndarray,
    res: np.ndarray,
) -> None:
    """res[:m] = RAM merge of the tile's rows vals = (base, task_1, ..., task_N, then the
    base at the tasks' precisions: `load_tile_bases`), float32; task t's update is measured
    against row `rows[t]`, the merged value built on the base's own row."""
    ntasks = rows.size
    base = vals[0]
    zero = np.float32(0.0)
    for i in range(m):
        total[i] = zero
        count[i] = 0
        scale[i] = zero
    for t in range(ntasks):
        x = vals[t + 1]
        at = vals[rows[t]]
        lam_t = lam[t]
        for i in range(m):
            tau = x[i] - at[i]
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


@njit(cache=True, **OPTIONS)
def _merge_kernel(
    inputs: tuple[np.ndarray, ...], eps: np.float32, lam: np.ndarray, out: np.ndarray, nan_bits: int
) -> None:
    """out[:] = RAM merge of inputs = (base, task_1, ..., task_N), cast to out's dtype."""
    n, buf, vals, rows = tiles_of(inputs, TILE)
    total = np.empty(TILE, np.float32)
    count = np.empty(TILE, np.int32)
    scale = np.empty(TILE, np.float32)
    res = np.empty(TILE, np.float32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        _ram_tile(vals, rows, m, eps, lam, total, count, scale, res)
        store_span(res[:m], out, lo, nan_bits)


@njit(cache=True, **OPTIONS)
def _merge_fp8_kernel(
    inputs: tuple[Any, ...],
    eps: np.float32,
    lam: np.ndarray,
    cols: int,
    bm: int,
    bn: int,
    bf16_scales: bool,
    base_q: np.ndarray,
    q_out: np.ndarray,
    s_out: np.ndarray,
    same_out: np.ndarray,
) -> None:
    """The RAM merge of inputs = (base, task_1, ..., task_N), whole bands of `bm` rows of
    `cols`, written as FP8 blocks of bm x bn, a band at a time: the merged float32 values `y`
    of the band tile by tile (each block's amax and whether it is the base's values bit for
    bit gathered on the way, while the tile is in cache), then per block `same_out[k]` = 1
    when it is (the block keeps `base_q`'s bytes), else `s_out[k]` = the block's scale as
    stored (`amax / 448`, 1 where amax is 0; rounded to bfloat16 when `bf16_scales`) and the
    bytes `e4m3fn(y / s_out[k])` into `q_out` (left alone when it is empty: scales only)."""
    per = (cols + bn - 1) // bn
    n, buf, vals, rows = tiles_of(inputs, TILE)
    total = np.empty(TILE, np.float32)
    count = np.empty(TILE, np.int32)
    scale = np.empty(TILE, np.float32)
    res = np.empty(TILE, np.float32)
    res_bits = res.view(np.uint32)
    band = bm * cols
    y = np.empty(min(band, n), np.float32)
    quotient = np.empty(bn, np.float32)
    quotient_bits = quotient.view(np.uint32)
    amax = np.empty(per, np.float32)
    differ = np.empty(per, np.uint32)
    write = q_out.size > 0
    for b0 in range(0, n, band):
        size = min(band, n - b0)
        amax[:] = 0.0
        differ[:] = 0
        for lo in range(0, size, TILE):
            m = min(TILE, size - lo)
            load_tile_bases(inputs, b0 + lo, m, buf)
            _ram_tile(vals, rows, m, eps, lam, total, count, scale, res)
            y[lo : lo + m] = res[:m]
            # each run of one row within one block: its block's amax and bits compared
            col = lo % cols
            block = col // bn
            done = 0
            while done < m:
                run = min(m - done, min(block * bn + bn, cols) - col)
                got = res[done : done + run]
                got_bits = res_bits[done : done + run]
                base_bits = buf[0, done : done + run]
                top = amax[block]
                d = differ[block]
                nan = False
                for i in range(run):  # branch-free: vectorizes
                    a = abs(got[i])
                    top = a if a > top else top
                    nan |= a != a
                    d |= got_bits[i] ^ base_bits[i]
                differ[block] = d
                if amax[block] != amax[block]:
                    pass  # NaN is sticky, as numpy's max
                elif nan:  # the first NaN's bits, as numpy's max gives them
                    for i in range(run):
                        if got[i] != got[i]:
                            amax[block] = abs(got[i])
                            break
                else:
                    amax[block] = top
                done += run
                col += run
                block += 1
                if col == cols:
                    col, block = 0, 0
        first = b0 // band * per
        for block in range(per):
            k = first + block
            same_out[k] = 1 if differ[block] == 0 else 0
            a = amax[block]
            s = np.float32(1.0) if a == np.float32(0.0) else a / np.float32(448.0)
            if bf16_scales:
                s = float32_of(_U32(float_bits_to_bf16(bits(s), -1)) << _U32(16))
            s_out[k] = s
        if not write:
            continue
        for r0 in range(0, size, cols):
            for block in range(per):
                c0 = block * bn
                w = min(bn, cols - c0)
                at = b0 + r0 + c0
                out = q_out[at : at + w]
                if differ[block] == 0:
                    out[:] = base_q[at : at + w]
                    continue
                s = s_out[first + block]
                row = y[r0 + c0 : r0 + c0 + w]
                for j in range(w):
                    quotient[j] = row[j] / s
                for j in range(w):
                    out[j] = np.uint8(e4m3_code(quotient_bits[j]))


# ---- Python API ------------------------------------------------------------------------


def supports(inputs: Sequence[torch.dtype], out: torch.dtype | None = None) -> bool:
    """Whether the fused kernels take these torch input dtypes (and output dtype); float64
    inputs, and anything else, stay on the eager path (`ram_dist.kernels.handle` answers
    the same for safetensors dtype names)."""
    from ram_dist.dtypes import TORCH_TO_SAFETENSORS as names

    read = [names.get(d, "") for d in inputs]
    return handle(read, None if out is None else names.get(out, ""))


def overlap_counts(
    base: ArrayLike, tasks: Sequence[ArrayLike], eps: float, *, code_tasks: int = CODE_TASKS
) -> np.ndarray:
    """int64 [N+1, N+1], equal to `methods.ram.overlap_statistics(base, tasks, eps)`.

    `code_tasks` picks the counting strategy (both exact; tests force each)."""
    arrays = kernel_inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    _count_kernel(arrays, np.float32(eps), hist, np.zeros(0, np.int64), code_tasks, _NO_CHECKS)
    return hist


def overlap_counts_nonfinite(
    base: ArrayLike, tasks: Sequence[ArrayLike], eps: float, *, code_tasks: int = CODE_TASKS
) -> tuple[np.ndarray, list[int]]:
    """`overlap_counts`, plus the NaN and Inf count of every input (base first) from the
    same sweep: the reduce pass's finiteness check without reading the inputs again."""
    arrays = kernel_inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    nonfinite = np.zeros(ntasks + 1, np.int64)
    _count_kernel(arrays, np.float32(eps), hist, nonfinite, code_tasks, _NO_CHECKS)
    return hist, nonfinite.tolist()


def overlap_counts_checked(
    base: ArrayLike, tasks: Sequence[ArrayLike], eps: float, *, code_tasks: int = CODE_TASKS
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """`overlap_counts_nonfinite`, plus the precision check of every task (int64 [N, 3],
    `precision.check_counts`) from the same sweep: the first reduce round of an FP8 or
    float32 base reads and decodes each input once."""
    arrays = kernel_inputs(base, tasks)
    ntasks = len(arrays) - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    nonfinite = np.zeros(ntasks + 1, np.int64)
    checks = np.zeros((ntasks, 3), np.int64)
    _count_kernel(arrays, np.float32(eps), hist, nonfinite, code_tasks, checks)
    return hist, nonfinite.tolist(), checks


#: `_count_kernel`'s `checks` when none is asked for (one signature either way).
_NO_CHECKS = np.zeros((0, 3), np.int64)


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
    arrays, target, nan_bits, _ = merge_records(base, tasks, out, bf16_nan)
    if len(lambdas) != len(arrays) - 1:
        raise ValueError(f"{len(lambdas)} lambdas for {len(arrays) - 1} tasks")
    lam = np.asarray(lambdas, dtype=np.float64).astype(np.float32)
    _merge_kernel(arrays, np.float32(eps), lam, target, nan_bits)


def merge_ram_fp8(
    base: Fp8Values,
    tasks: Sequence[ArrayLike | Fp8Values],
    eps: float,
    lambdas: Sequence[float],
    target: Fp8Target,
) -> None:
    """`fp8.requantize(merge_ram(...) in float32, ...)` in one sweep: the merged bands of an
    FP8 base written as FP8 blocks of the base's size (e4m3fn bytes into `target.q`, unless
    it is empty; the bands' scale bytes into `target.scales`, in `target.scale_dtype`), the
    unchanged blocks as the base's bytes. The inputs cover whole bands of the base's
    blocks."""
    if not isinstance(base, Fp8Values):
        raise TypeError("an FP8 output needs an FP8 base")
    arrays = kernel_inputs(base, tasks)
    if len(lambdas) != len(arrays) - 1:
        raise ValueError(f"{len(lambdas)} lambdas for {len(arrays) - 1} tasks")
    q, _, cols, bm, bn = kernel_view(base, False)
    if target.q.size not in (0, q.size):
        raise ValueError(f"FP8 output of {target.q.size} bytes for {q.size} elements")
    blocks = -(-q.size // (bm * cols)) * -(-cols // bn)
    fresh = np.empty(blocks, np.float32)
    same = np.empty(blocks, np.uint8)
    lam = np.asarray(lambdas, dtype=np.float64).astype(np.float32)
    out = target.q.reshape(-1).view(np.uint8)
    _merge_fp8_kernel(
        arrays, np.float32(eps), lam, cols, bm, bn, target.scale_dtype == "BF16", q, out,
        fresh, same,
    )  # fmt: skip
    stored = stored_scales(fresh, same, target.base_scales, target.scale_dtype)
    target.scales.reshape(-1).view(np.uint8)[:] = stored


def fma_instructions() -> list[str]:
    """`fma_findings` of the kernels, for every signature they have been called with. Must
    be empty: an FMA rounds once where the spec rounds twice."""
    found: list[str] = []
    for kernel in (_count_kernel, _merge_kernel, _merge_fp8_kernel):
        found += fma_findings(kernel)
    return found


def warm_calls() -> Iterator[Call]:
    """RAM's kernels, once each (`kernels.warm`): counts and merge, and the merge into FP8."""
    from ram_dist.kernels.warm import EPS, N, sample

    base, agents, out = sample()
    yield _count_kernel, "records", partial(overlap_counts_nonfinite, base, agents, EPS)
    yield _merge_kernel, "records", partial(merge_ram, base, agents, EPS, [1.0], out)
    fp8_base = Fp8Values(np.zeros(N, np.uint8), np.ones(4, np.float32), 4, (2, 2))
    scales = np.ones(4, np.float32).view(np.uint8)
    target = Fp8Target(np.empty(N, np.uint8), "F32", scales, np.empty_like(scales))
    to_fp8 = partial(merge_ram_fp8, fp8_base, [fp8_base], EPS, [1.0], target)
    yield _merge_fp8_kernel, "records -> fp8", to_fp8


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
