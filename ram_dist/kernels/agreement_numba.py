"""A fused CPU kernel (numba) for `probe`'s statistics: RAM's overlap counts and the
agreement statistics (`methods.agreement.agreement_statistics`: pair counts, sign agreement
per task, exact |tau| sums per float32 exponent) in one sweep over the inputs, integers equal
to the eager (torch) rule's.

Same tile pattern as RAM's count kernel (`ram_numba._count_kernel`): inputs as records
(`views.kernel_inputs`, one signature for every dtype, stored form and task count), each
tile widened to float32 bits with the base at each task's precision (`load_tile_bases`),
`tau = x_t - b` and `|tau| > float32(eps)` op for op as the eager rule, the NaN/Inf count and
the precision check from the same tile. The torch rule's sign rules are kept as written:
`up = m & (tau > 0)`, `down = m & (tau < 0)`, and an element's "downs" are `c - ups`. Each
|tau| of a changed element adds its 24-bit significand to its exponent's bin
(`agreement.float32_sum`'s rule). No fastmath (no FMA: `fma_instructions`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.fma_check import fma_findings
from ram_dist.kernels.precision_numba import check_inputs, task_tests
from ram_dist.kernels.primitives import (
    LANES,
    OPTIONS,
    TILE,
    load_tile_bases,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, kernel_inputs

#: `agreement.EXPONENTS`: one |tau| bin per float32 exponent (kernels import no method).
EXPONENTS = 256

use_writable_cache()  # before the first `@njit(cache=True)` picks numba's cache directory


@njit(cache=True, **OPTIONS)
def _agreement_kernel(
    inputs: np.ndarray,
    eps: np.float32,
    hist: np.ndarray,
    nonfinite: np.ndarray,
    checks: np.ndarray,
    pairs: np.ndarray,
    agree: np.ndarray,
    magnitude: np.ndarray,
) -> None:
    """hist[:] += RAM's overlap statistics of inputs = (base, task_1, ..., task_N);
    pairs [2, N, N], agree [N], magnitude [N, 2, EXPONENTS] += the agreement statistics;
    when nonfinite has N+1 entries, nonfinite[j] += NaN and Inf count of input j; when
    `checks` has N rows, checks[t] += the precision check of task t."""
    ntasks = inputs.shape[0] - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    tests = task_tests(inputs)
    scratch = np.empty((2, TILE), np.uint32)
    tau = np.empty((ntasks, TILE), np.float32)
    tau_bits = tau.view(np.uint32)
    # per task and element: 0 unchanged, 1 changed up, 2 changed down, 3 changed and neither
    # (tau zero, only when eps < 0)
    sign = np.empty((ntasks, TILE), np.int8)
    count = np.empty(TILE, np.int64)
    ups = np.empty(TILE, np.int64)
    tally = np.zeros((LANES, ntasks, ntasks + 1), np.int64)  # hist's task rows, per lane
    sums = np.zeros((LANES, ntasks, 2, EXPONENTS), np.int64)  # magnitude, per lane
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        check_inputs(buf, rows, tests, m, eps, nonfinite, checks, scratch)
        for i in range(m):
            count[i] = 0
            ups[i] = 0
        for t in range(ntasks):
            x = vals[t + 1]
            base = vals[rows[t]]
            d = tau[t]
            s = sign[t]
            for i in range(m):
                v = x[i] - base[i]
                d[i] = v
                changed = abs(v) > eps
                code = 1 if v > 0 else (2 if v < 0 else 3)
                s[i] = code if changed else 0
                count[i] += 1 if changed else 0
                ups[i] += 1 if changed and code == 1 else 0
        for i in range(m):
            hist[ntasks, count[i]] += 1
        for t in range(ntasks):
            s = sign[t]
            d = tau_bits[t]
            changes = 0
            agreeing = 0
            for i in range(m):  # branch-free, each lane its own bins: no chain through memory
                code = s[i]
                w = np.int64(code != 0)
                c = count[i]
                lane = i & (LANES - 1)
                changes += w
                tally[lane, t, c] += w
                b = d[i] & np.uint32(0x7FFFFFFF)
                e = np.int64(b >> np.uint32(23))
                sig = np.int64(b & np.uint32(0x7FFFFF)) | (np.int64(e > 0) << 23)
                sums[lane, t, np.int64(c > 1), e] += sig * w
                up = ups[i]
                agrees = (np.int64(code == 1) & np.int64(c == up)) | (
                    np.int64(code == 2) & np.int64(up == 0)
                )
                agreeing += agrees & np.int64(c > 1)
            agree[t] += agreeing
            pairs[0, t, t] += changes
            pairs[1, t, t] += changes
            for u in range(t + 1, ntasks):
                r = sign[u]
                both = 0
                same = 0
                for i in range(m):
                    a = s[i]
                    both += 1 if a != 0 and r[i] != 0 else 0
                    same += 1 if a == r[i] and (a == 1 or a == 2) else 0
                pairs[0, t, u] += both
                pairs[0, u, t] += both
                pairs[1, t, u] += same
                pairs[1, u, t] += same
    for lane in range(LANES):
        for t in range(ntasks):
            for c in range(ntasks + 1):
                hist[t, c] += tally[lane, t, c]
            for k in range(2):
                for e in range(EXPONENTS):
                    magnitude[t, k, e] += sums[lane, t, k, e]


def agreement_counts(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    eps: float,
    *,
    count_nonfinite: bool = False,
    check: bool = False,
) -> tuple[
    np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray], list[int] | None, np.ndarray | None
]:
    """(RAM's overlap counts int64 [N+1, N+1], the agreement statistics (pairs, agree,
    magnitude; `methods.agreement.KEYS` in order), each input's NaN/Inf count (base first)
    when `count_nonfinite`, the precision check int64 [N, 3] when `check`), one sweep; the
    integers `agreement.agreement_statistics` gives."""
    arrays = kernel_inputs(base, tasks)
    ntasks = arrays.shape[0] - 1
    hist = np.zeros((ntasks + 1, ntasks + 1), np.int64)
    nonfinite = np.zeros(ntasks + 1 if count_nonfinite else 0, np.int64)
    checks = np.zeros((ntasks if check else 0, 3), np.int64)
    pairs = np.zeros((2, ntasks, ntasks), np.int64)
    agree = np.zeros(ntasks, np.int64)
    magnitude = np.zeros((ntasks, 2, EXPONENTS), np.int64)
    _agreement_kernel(arrays, np.float32(eps), hist, nonfinite, checks, pairs, agree, magnitude)
    counts = nonfinite.tolist() if count_nonfinite else None
    return hist, (pairs, agree, magnitude), counts, (checks if check else None)


def fma_instructions() -> list[str]:
    """`fma_findings` of the kernel, for every signature it has been called with. Must be
    empty."""
    return fma_findings(_agreement_kernel)


def warm_calls() -> Iterator[Call]:
    """The probe's kernel, once (`kernels.warm`): one signature for every input."""
    from ram_dist.kernels.warm import EPS, sample

    base, agents, _ = sample()
    yield _agreement_kernel, "records", partial(agreement_counts, base, agents, EPS)


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
