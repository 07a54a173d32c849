"""RAM's fused kernels reading FP8 inputs as stored (e4m3 bytes and block scales, no float32
copy) and writing FP8 output in the same sweep, byte for byte against the path they
replace: each input dequantized by the numpy rule, merged in float32 by the fused kernel,
then requantized by the numpy rule (`kernels.fp8`, itself checked against torch in
`test_fp8_kernels.py` and against the spec's reference end to end).

The blocks are random and made to hit the rules' edges: blocks no task changed (the base's
bytes and scale), blocks merged to all zeros (scale 1), e4m3 subnormals and float32
subnormal values, values at and past 448 times the scale (saturation), NaN codes, ragged
edge blocks (rows and columns that are not multiples of the block), tasks with blocks of
another size, BF16 scales, and chunks of whole bands merged one by one (the planner cuts an
FP8 weight only at bands of every input's block height and the output's)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ram_dist import kernels
from ram_dist.kernels import fp8

pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="numba is not installed"),
    # numpy's requantize divides inf by an inf scale (a block of 1e30 scales): NaN, as meant
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
]

EPS = 1e-5
LAMBDAS = [1.1, 0.9, 1.25]


class Fp8Input:
    """One FP8 input of `rows` x `cols`: e4m3 bytes, raw scale bytes and their dtype."""

    def __init__(self, q: np.ndarray, scales: np.ndarray, cols: int, block, scale_dtype: str):
        self.q, self.raw, self.cols, self.block, self.dtype = q, scales, cols, block, scale_dtype

    def values(self) -> np.ndarray:
        """The old path: the numpy rule's dequantized float32 copy."""
        s = fp8.scale_values(self.raw, self.dtype)
        out = np.empty(self.q.size, np.float32)
        return fp8.dequantize(self.q, s, self.cols, self.block, out, fast=False)

    def stored(self, first: int = 0, last: int | None = None) -> fp8.Fp8Values:
        """What the kernels read: bands [first, last) as stored."""
        bm, bn = self.block
        rows = self.q.size // self.cols
        last = -(-rows // bm) if last is None else last
        per = -(-self.cols // bn)
        q = self.q[first * bm * self.cols : min(last * bm, rows) * self.cols]
        s = fp8.scale_values(self.raw, self.dtype)[first * per : last * per]
        return fp8.Fp8Values(q, np.ascontiguousarray(s), self.cols, self.block)

    def scale_rows(self, first: int, last: int) -> np.ndarray:
        per = -(-self.cols // self.block[1]) * (4 if self.dtype == "F32" else 2)
        return self.raw[first * per : last * per]


def _codes(rng: np.random.Generator, n: int, nan: bool) -> np.ndarray:
    q = rng.integers(0, 256, n, dtype=np.uint8)
    if not nan:
        q[(q & 0x7F) == 0x7F] = 0x80  # no NaN: -0 instead
    return q


def _scales(rng: np.random.Generator, count: int, dtype: str) -> np.ndarray:
    s = (rng.random(count) * 1e-2).astype(np.float32)
    s[::7] = np.float32(2.0**-140)  # products in float32's subnormal range
    s[3::11] = np.float32(1e30)  # large values
    return fp8.scale_bytes(s, dtype)


def make_set(rows: int, cols: int, block, scale_dtype: str, seed: int, nan: bool = False,
             task_block=None):  # fmt: skip
    """A base and three tasks (FP8; the first task's blocks are `task_block`): block (0, 0)
    no task changes, block (1, 1) two tasks set to zero and the third leaves (merged to all
    zeros), e4m3 subnormal and maximal codes, and, with `nan`, NaN codes."""
    rng = np.random.default_rng(seed)
    n = rows * cols
    bm, bn = block
    per = -(-cols // bn)
    size = 4 if scale_dtype == "F32" else 2
    base_q = _codes(rng, n, nan)
    base_q[: min(n, 40)] = np.arange(min(n, 40), dtype=np.uint8) % 8  # e4m3 subnormals
    base_q[-min(n, 9) :] = 0x7E  # 448
    base_raw = _scales(rng, -(-rows // bm) * per, scale_dtype)
    zero_block = rows > bm and cols > bn
    if zero_block:  # block (1, 1): values of a normal scale, so that each change counts
        base_raw[(per + 1) * size : (per + 2) * size] = fp8.scale_bytes(
            np.ones(1, np.float32), scale_dtype
        )
    base = Fp8Input(base_q, base_raw, cols, block, scale_dtype)
    tasks = []
    for t in range(3):
        tb = task_block if (t == 0 and task_block) else block
        q = base_q.copy().reshape(rows, cols)
        change = rng.random((rows, cols)) < (0.1, 0.5, 0.9)[t]
        q[change] = _codes(rng, int(change.sum()), nan)
        raw = _scales(rng, -(-rows // tb[0]) * -(-cols // tb[1]), scale_dtype)
        if tb == block:  # some blocks' scales are the base's, the others not
            keep = np.repeat(rng.random(raw.size // size) < 0.3, size)
            raw = np.where(keep, base_raw, raw)
            q[:bm, :bn] = base_q.reshape(rows, cols)[:bm, :bn]  # block (0, 0): as the base
            raw[:size] = base_raw[:size]
        if zero_block and t == 0 and tb == block:
            q[bm : 2 * bm, bn : 2 * bn] = base_q.reshape(rows, cols)[bm : 2 * bm, bn : 2 * bn]
            raw[(per + 1) * size : (per + 2) * size] = base_raw[(per + 1) * size : (per + 2) * size]
        elif zero_block and t > 0:
            q[bm : 2 * bm, bn : 2 * bn] = 0
        tasks.append(Fp8Input(q.reshape(-1), raw, cols, tb, scale_dtype))
    return base, tasks


def _bf16(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _old_merge(base_x, tasks_x, out):
    kernels_ram().merge_ram(base_x, tasks_x, EPS, LAMBDAS[: len(tasks_x)], out)
    return out


def kernels_ram():
    from ram_dist.kernels import ram_numba

    return ram_numba


CASES = [
    (300, 260, (128, 128)),  # ragged bands and blocks at the bottom and right
    (256, 384, (128, 128)),  # whole blocks
    (70, 45, (16, 8)),
    (5, 7, (16, 8)),  # one ragged block
]


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16"])
@pytest.mark.parametrize("rows, cols, block", CASES)
def test_stored_fp8_inputs_give_the_dequantized_inputs_bytes(rows, cols, block, scale_dtype):
    ram = kernels_ram()
    base, tasks = make_set(rows, cols, block, scale_dtype, seed=rows + cols)
    xs = [i.values() for i in (base, *tasks)]
    # the reduce pass: counts and NaN/Inf counts
    want = ram.overlap_counts_nonfinite(xs[0], xs[1:], EPS)
    got = ram.overlap_counts_nonfinite(base.stored(), [t.stored() for t in tasks], EPS)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    # the map pass into a plain dtype (--out-dtype; a base that is not FP8)
    for dtype in (np.float32, np.uint16, np.float16):
        old = _old_merge(xs[0], xs[1:], np.empty(rows * cols, dtype))
        new = np.empty(rows * cols, dtype)
        ram.merge_ram(base.stored(), [t.stored() for t in tasks], EPS, LAMBDAS, new)
        assert np.array_equal(new.view(np.uint8), old.view(np.uint8)), dtype
    # the map pass written as FP8 again, in one sweep
    y = _old_merge(xs[0], xs[1:], np.empty(rows * cols, np.float32))
    q_old = np.empty(rows * cols, np.uint8)
    s_old = fp8.requantize(y, xs[0], base.q, base.raw, cols, block, scale_dtype, q_old, fast=False)
    q_new = np.empty(rows * cols, np.uint8)
    target = fp8.Fp8Target(q_new, scale_dtype, base.raw, np.empty_like(base.raw))
    ram.merge_ram_fp8(base.stored(), [t.stored() for t in tasks], EPS, LAMBDAS, target)
    assert np.array_equal(target.scales, s_old)
    assert np.array_equal(q_new, q_old)
    if rows > block[0] and cols > block[1]:  # the edges were hit
        itemsize = 4 if scale_dtype == "F32" else 2
        assert np.array_equal(target.scales[:itemsize], base.raw[:itemsize])  # unchanged
        assert np.array_equal(q_new[: block[1]], base.q[: block[1]])
        per = -(-cols // block[1])
        assert fp8.scale_values(target.scales, scale_dtype)[per + 1] == 1  # merged to zeros
        bm, bn = block
        assert (q_new.reshape(rows, cols)[bm : 2 * bm, bn : 2 * bn] & 0x7F == 0).all()


@pytest.mark.parametrize(
    "base_fp8, task_fp8", [(True, (False, False, False)), (False, (True, False, True))]
)
def test_fp8_and_bf16_inputs_mixed(base_fp8, task_fp8):
    """An FP8 base with bf16 agents (written as FP8), and a bf16 base with FP8 agents."""
    ram = kernels_ram()
    rows, cols, block = 300, 260, (128, 128)
    base, tasks = make_set(rows, cols, block, "F32", seed=3)
    inputs = [base, *tasks]
    flags = (base_fp8, *task_fp8)
    # a bf16 input holds the bf16 rounding of the FP8 values
    plain = [_bf16(i.values()) for i in inputs]
    stored = [i.stored() if f else p for i, p, f in zip(inputs, plain, flags, strict=True)]
    # the same values decoded: FP8 inputs as float32, bf16 ones as bf16 (a bf16 task of an
    # FP8 base is measured against the base rounded to bf16, either way)
    xs = [i.values() if f else p for i, p, f in zip(inputs, plain, flags, strict=True)]
    want = ram.overlap_counts_nonfinite(xs[0], xs[1:], EPS)
    got = ram.overlap_counts_nonfinite(stored[0], stored[1:], EPS)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    old = _old_merge(xs[0], xs[1:], np.empty(rows * cols, np.uint16))
    new = np.empty(rows * cols, np.uint16)
    ram.merge_ram(stored[0], stored[1:], EPS, LAMBDAS, new)
    assert np.array_equal(new, old)
    if base_fp8:
        y = _old_merge(xs[0], xs[1:], np.empty(rows * cols, np.float32))
        q_old = np.empty(rows * cols, np.uint8)
        s_old = fp8.requantize(y, xs[0], base.q, base.raw, cols, block, "F32", q_old, fast=False)
        target = fp8.Fp8Target(np.empty_like(q_old), "F32", base.raw, np.empty_like(base.raw))
        ram.merge_ram_fp8(stored[0], stored[1:], EPS, LAMBDAS, target)
        assert np.array_equal(target.q, q_old) and np.array_equal(target.scales, s_old)


def test_band_chunks_and_tasks_with_other_blocks():
    """Chunks of whole bands of every input (the planner's cuts: the least common multiple
    of the block heights), merged one by one, give the whole tensor's bytes; a task with
    64 x 32 blocks under a base with 128 x 128 ones; NaN codes included."""
    ram = kernels_ram()
    rows, cols, block, task_block = 600, 300, (128, 128), (64, 32)
    base, tasks = make_set(rows, cols, block, "BF16", seed=7, nan=True, task_block=task_block)
    xs = [i.values() for i in (base, *tasks)]
    y = _old_merge(xs[0], xs[1:], np.empty(rows * cols, np.float32))
    q_old = np.empty(rows * cols, np.uint8)
    s_old = fp8.requantize(y, xs[0], base.q, base.raw, cols, block, "BF16", q_old, fast=False)
    want_counts = ram.overlap_counts_nonfinite(xs[0], xs[1:], EPS)
    assert want_counts[1][0] > 0  # the NaN codes are there
    step = math.lcm(block[0], task_block[0])  # rows per cut
    q_new = np.empty_like(q_old)
    s_new = []
    hist = np.zeros_like(want_counts[0])
    nonfinite = np.zeros(4, np.int64)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        chunk = [
            i.stored(r0 // i.block[0], -(-r1 // i.block[0])) for i in (base, *tasks)
        ]  # fmt: skip
        h, counts = ram.overlap_counts_nonfinite(chunk[0], chunk[1:], EPS)
        hist += h
        nonfinite += counts
        first, last = r0 // block[0], -(-r1 // block[0])
        raw = base.scale_rows(first, last)
        target = fp8.Fp8Target(q_new[r0 * cols : r1 * cols], "BF16", raw, np.empty_like(raw))
        ram.merge_ram_fp8(chunk[0], chunk[1:], EPS, LAMBDAS, target)
        s_new.append(target.scales)
        # the scales alone (bands merged only for the scale tensor after their weight)
        alone = fp8.Fp8Target(np.empty(0, np.uint8), "BF16", raw, np.empty_like(raw))
        ram.merge_ram_fp8(chunk[0], chunk[1:], EPS, LAMBDAS, alone)
        assert np.array_equal(alone.scales, target.scales)
    assert np.array_equal(hist, want_counts[0]) and nonfinite.tolist() == want_counts[1]
    assert np.array_equal(np.concatenate(s_new), s_old)
    assert np.array_equal(q_new, q_old)


def test_e4m3_values_are_the_table():
    """The kernels compute each code's value (`primitives.e4m3_bits`) rather than look it up:
    every one of the 256 equals `fp8.E4M3_VALUES`, the table, bit for bit."""
    ram = kernels_ram()
    q = np.arange(256, dtype=np.uint8)
    every = fp8.Fp8Values(q, np.ones(1, np.float32), 256, (1, 256))
    out = np.empty(256, np.float32)
    ram.merge_ram(every, [every], EPS, [1.0], out)  # no change: the base's values
    assert np.array_equal(out.view(np.uint32), fp8.E4M3_VALUES.view(np.uint32))
    h, counts = ram.overlap_counts_nonfinite(every, [every], EPS)
    assert counts == [2, 2]  # 0x7F and 0xFF are NaN


def test_no_fma_in_the_fp8_kernels():
    """The kernels' code for FP8 inputs (and FP8 output) has no FMA (`fma_findings`)."""
    from ram_dist.kernels import views

    ram = kernels_ram()
    base, tasks = make_set(70, 45, (16, 8), "F32", seed=1)
    plain = _bf16(tasks[2].values())
    arrays = views.kernel_inputs(base.stored(), [tasks[0].stored(), plain])
    eps, lam = np.float32(EPS), np.array([1.1, 1.2], np.float32)
    fresh = {k: getattr(ram, k) for k in ("_count_kernel", "_merge_kernel", "_merge_fp8_kernel")}
    hist, checks = np.zeros((3, 3), np.int64), np.zeros((2, 3), np.int64)  # the check too
    fresh["_count_kernel"](arrays, eps, hist, np.zeros(3, np.int64), 10, checks)
    out = views.kernel_output(np.empty(70 * 45, np.float32), 70 * 45)
    fresh["_merge_kernel"](arrays, eps, lam, out, 0xFFFF)
    q = np.empty(70 * 45, np.uint8)
    s, same = np.empty(5 * 6, np.float32), np.empty(5 * 6, np.uint8)
    fresh["_merge_fp8_kernel"](arrays, eps, lam, 45, 16, 8, False, base.q, q, s, same)
    for kernel in fresh.values():
        assert kernel.signatures and ram.fma_findings(kernel) == []
