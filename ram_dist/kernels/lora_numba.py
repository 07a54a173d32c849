"""The LoRA values of `lora`'s rule (numba), byte for byte its numpy version: per tile of a
row's columns, the float32 product accumulated over k in a scratch (the inner loop runs
along the row, so it vectorizes without reordering any sum; four rows share each load of
`basis`), then each element's `float32(theta_B^t) + s * P` rounded into the task's dtype.

The base's values of a tile are loaded into a float32 scratch of `TILE` first: from a typed
array of its stored elements (bfloat16, float16, float32), or, for a quantized base (block
FP8, compressed-tensors' FP8 and packed INT4/INT8, fbgemm_fp8), from its record
(`views.kernel_record`), decoded from its codes and scales as they are loaded
(`primitives.load_span`), so no copy of the base's values is made first; then rounded to the
task's dtype where the task measures against the base at its precision (`round_bits`).
`fastmath` stays off, so no multiply and add is contracted into an FMA (`fma_instructions`
checks the compiled code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ram_dist.kernels import use_writable_cache
from ram_dist.kernels.fma_check import fma_findings
from ram_dist.kernels.primitives import (
    F32,
    OPTIONS,
    load,
    load_span,
    round_bits,
    store,
)
from ram_dist.kernels.shared_cache import share_compiles

if TYPE_CHECKING:
    from ram_dist.kernels.warm import Call

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory


#: Columns computed at once: four rows' float32 scratch of this many stays in L1.
TILE = 256
#: Columns of a register block of four rows (`_block4`): 4 x 16 running sums, eight AVX2
#: registers.
BLOCK = 16
#: Running sums held in registers at once (`_registers`): 4 rows x `BLOCK`, or one row's
#: `REGS` columns.
REGS = 4 * BLOCK


def load_theta(theta: np.ndarray, at: int, w: int, dst: np.ndarray) -> None:
    """dst[:w] = float32 bits of the base's elements [at, at + w) of the block: a typed
    array's (`load`), or a quantized base's record's (int64: `load_span`, decoding them)."""
    raise NotImplementedError


@overload(load_theta, jit_options={"fastmath": False, "error_model": "numpy"})
def _load_theta_impl(theta: Any, at: Any, w: Any, dst: Any) -> Callable[..., None]:
    if theta.dtype == types.int64:  # a record (`views.kernel_record`)

        def from_record(theta: Any, at: Any, w: Any, dst: Any) -> None:
            load_span(theta, at, w, dst[:w])

        return from_record

    def from_array(theta: Any, at: Any, w: Any, dst: Any) -> None:
        load(theta[at : at + w], dst[:w])

    return from_array


@intrinsic
def _registers(typingctx):  # noqa: ANN001, ANN202  (numba's intrinsic protocol)
    """A pointer to `REGS` float32 on the stack (one `alloca` in the function's entry block):
    LLVM keeps such an array in registers once the loops over it are unrolled, where it
    must keep a heap array (`np.empty`) in memory, not knowing that nothing else points to
    it."""

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=REGS)

    return types.CPointer(types.float32)(), codegen


@njit(cache=True, **OPTIONS)
def _packed(basis):  # noqa: ANN001, ANN202  (numba arrays)
    """`basis`'s whole blocks of `BLOCK` columns, each block's [r, BLOCK] contiguous:
    `packed[b, k, c] = basis[k, b * BLOCK + c]`. A register block then reads its k steps
    one after the other, where `basis`'s rows, a row's width apart, would fall in the same
    few cache sets (rows of 2048 float32 are 8 KiB apart: all in one set of L1's)."""
    r, cols = basis.shape
    packed = np.empty((cols // BLOCK, r, BLOCK), dtype=np.float32)
    for b in range(cols // BLOCK):
        for k in range(r):
            src, dst = basis[k, b * BLOCK : (b + 1) * BLOCK], packed[b, k]
            for c in range(BLOCK):
                dst[c] = src[c]
    return packed


@njit(cache=True, **OPTIONS)
def _block4(coef, packed, i, j, dst, d):  # noqa: ANN001, ANN202  (numba arrays)
    """`dst[q, d : d + BLOCK] = sum_k coef[i + q, k] * basis[k, j : j + BLOCK]`, q < 4, j a
    multiple of `BLOCK` (`packed`: `_packed(basis)`), k ascending from the k = 0 product,
    each product and each addition rounded: the running sums stay in registers across k
    (`_registers`)."""
    panel = packed[j // BLOCK]
    a = carray(_registers(), (4, BLOCK))
    c0, c1, c2, c3 = coef[i, 0], coef[i + 1, 0], coef[i + 2, 0], coef[i + 3, 0]
    row = panel[0]
    for c in range(BLOCK):
        b = row[c]
        a[0, c] = c0 * b
        a[1, c] = c1 * b
        a[2, c] = c2 * b
        a[3, c] = c3 * b
    for k in range(1, panel.shape[0]):
        c0, c1, c2, c3 = coef[i, k], coef[i + 1, k], coef[i + 2, k], coef[i + 3, k]
        row = panel[k]
        for c in range(BLOCK):
            b = row[c]
            a[0, c] = a[0, c] + c0 * b
            a[1, c] = a[1, c] + c1 * b
            a[2, c] = a[2, c] + c2 * b
            a[3, c] = a[3, c] + c3 * b
    for q in range(4):
        out = dst[q, d : d + BLOCK]
        for c in range(BLOCK):
            out[c] = a[q, c]


@njit(cache=True, **OPTIONS)
def _block1(coef, packed, i, j, dst, d):  # noqa: ANN001, ANN202  (numba arrays)
    """`_block4` for one row, `REGS` columns (four blocks) at once."""
    first = j // BLOCK
    a = carray(_registers(), (4, BLOCK))
    c0 = coef[i, 0]
    for s in range(4):
        row = packed[first + s, 0]
        for c in range(BLOCK):
            a[s, c] = c0 * row[c]
    for k in range(1, packed.shape[1]):
        c0 = coef[i, k]
        for s in range(4):
            row = packed[first + s, k]
            for c in range(BLOCK):
                a[s, c] = a[s, c] + c0 * row[c]
    for s in range(4):
        out = dst[0, d + s * BLOCK : d + (s + 1) * BLOCK]
        for c in range(BLOCK):
            out[c] = a[s, c]


@njit(cache=True, **OPTIONS)
def _columns(coef, basis, i, rows, j, dst):  # noqa: ANN001, ANN202  (numba arrays)
    """`dst[q, :w] = sum_k coef[i + q, k] * basis[k, j : j + w]`, q < rows, w the width of
    `dst`: the same sums with the running sums in memory, for the columns a register block
    does not cover."""
    r, w = basis.shape[0], dst.shape[1]
    for q in range(rows):
        c0, row, out = coef[i + q, 0], basis[0, j : j + w], dst[q]
        for c in range(w):
            out[c] = c0 * row[c]
    for k in range(1, r):
        row = basis[k, j : j + w]
        for q in range(rows):
            c0, out = coef[i + q, k], dst[q]
            for c in range(w):
                out[c] = out[c] + c0 * row[c]


#: The functions `lora_values` calls (compiled on their own, which measured faster than
#: inlined into it: `fma_instructions` checks them too).
HELPERS = (_packed, _block4, _block1, _columns)


@njit(cache=True, **OPTIONS)
def lora_values(theta, coef, basis, scale, start, rounded, out):  # noqa: ANN001, ANN201  (numba arrays)
    """`out[e] = cast(float32(theta_B^t[e]) + scale * sum_k coef[i, k] * basis[k, j])` for
    the block's flat elements `start + e = (row0 + i) * cols + j`, e < out.size, k
    ascending, each step rounded; `theta_B^t` the base's value (`theta`: a typed array or a
    record) rounded to `rounded` (a kind code, `primitives.BF16` or `F16`; `F32`: as it is).

    Whole rows go four at a time, a tile of `TILE` columns at once, in register blocks of
    4 rows x `BLOCK` columns (each `basis` element loaded once for four rows, the running
    sums in registers across k); a row the elements cover in part goes alone, in blocks of
    `REGS` columns; columns outside whole blocks keep their sums in memory (`_columns`).
    Every element's sum is the same sequence of roundings either way."""
    n = out.size
    cols = basis.shape[1]
    row0 = start // cols
    packed = _packed(basis)
    acc = np.empty((4, TILE), dtype=np.float32)
    tbits = np.empty(TILE, dtype=np.uint32)
    res = np.empty(TILE, dtype=np.float32)
    e = 0
    while e < n:
        flat = start + e
        i = flat // cols - row0
        j0 = flat % cols
        m = min(cols - j0, n - e)
        rows = 4 if j0 == 0 and n - e >= 4 * cols else 1
        step = BLOCK if rows == 4 else REGS
        for jt in range(j0, j0 + m, TILE):
            w = min(TILE, j0 + m - jt)
            d = min(-jt % BLOCK, w)  # columns before the tile's first whole block
            if d:
                _columns(coef, basis, i, rows, jt, acc[:, :d])
            while d + step <= w:
                if rows == 4:
                    _block4(coef, packed, i, jt + d, acc, d)
                else:
                    _block1(coef, packed, i, jt + d, acc, d)
                d += step
            if d < w:
                _columns(coef, basis, i, rows, jt + d, acc[:, d:w])
            for q in range(rows):
                at = e + q * cols + (jt - j0)
                load_theta(theta, at, w, tbits)
                if rounded != F32:
                    round_bits(rounded, tbits[:w], tbits[:w])
                tvals = tbits[:w].view(np.float32)
                for j in range(w):
                    res[j] = tvals[j] + scale * acc[q, j]
                store(res[:w], out[at : at + w], -1)
        e += m if rows == 1 else 4 * cols
    return out


def fma_instructions() -> list[str]:
    """`fma_findings` of the kernel, for every signature it has been called with, and of each
    function it calls (in the kernel's cached object code, or compiled here with it). Must
    be empty: an FMA rounds once where the spec rounds twice."""
    found = fma_findings(lora_values)
    for helper in HELPERS:
        found += fma_findings(helper)
    return found


def warm_calls() -> Iterator[Call]:
    """A LoRA task's values through `kernels.lora`: over a base stored in the task's dtype
    (typed arrays, one signature per dtype: its spans of 256 columns measured 10% slower
    taken as records), and in bfloat16 over a quantized base's record (one signature for
    every format) (`kernels.warm`)."""
    from ram_dist.kernels import READS

    for theta in READS:
        yield lora_values, f"LoRA {theta} -> {theta}", partial(_lora, theta)
    yield lora_values, "LoRA quantized -> BF16", _lora_stored


def _lora(theta: str) -> None:
    """One LoRA product through `kernels.lora`, on a 4 x 4 weight of rank 2."""
    from ram_dist.dtypes import INFO
    from ram_dist.kernels import lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    zeros = np.zeros(16 * INFO[theta].itemsize, np.uint8)
    lora.values(zeros, theta, *factors, np.float32(1), 0, theta, np.empty(64, np.uint8))


def _lora_stored() -> None:
    """One LoRA product over a 4 x 4 block FP8 base (one scale), into bfloat16."""
    from ram_dist.kernels import fp8, lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    base = fp8.Fp8Values(np.zeros(16, np.uint8), np.ones(1, np.float32), 4, (4, 4))
    lora.values(base, "F32", *factors, np.float32(1), 0, "BF16", np.empty(64, np.uint8))


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
