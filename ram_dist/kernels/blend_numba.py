"""The geometric methods' map pass (numba): `((f_0 x_0 + f_1 x_1) + ...) / d + base` in
float32, one rounding per operation in input order (no fused multiply-add), with the
vectors `x_t` being the task vectors (`DELTAS`: task - base at the task's precision, one
rounding), the base and the one model (`PAIR`), the models (`MODELS`, no base), or the models
measured against the base (`REBASED`); written in the output's dtype. It is
`methods.geometric.span.blend`, element for element, on the stored bytes.

model_stock's map pass (`stock`) is another order of operations, so it has its own kernel:
`t * (((m_1 + 0) + m_2 + ...) / N) + (1 - t) * base` in float32, op by op, the models' values
as `PAIR` and `REBASED` take them, with t per row (`filter_wise`) or one per tensor.

`linear`'s map pass is the blend of the models (no base) with the sum started from +0.0
(`from_zero`: mergekit's zero accumulator, so a sum of -0.0 terms is +0.0). nearswap's is
its own kernel (`nearswap`): `w = clamp((1 / max(|a - b|, floor)) * t, 0, 1)`, then
`w * b + (1 - w) * a`, in float32, op by op `methods.nearswap.merge_chunk`.

Where a model's update is measured against the base at its precision (`kernels.precision`),
its value in `PAIR` and `REBASED` is `base + (model - base at its precision)`, as
`methods.task_vectors.task_values` gives it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
from numba import njit
from numba.extending import register_jitable

from ram_dist.kernels import Call, use_writable_cache
from ram_dist.kernels.primitives import (
    OPTIONS,
    TILE,
    load_tile,
    load_tile_bases,
    store_span,
    tiles_of,
)
from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.views import ArrayLike, merge_records

use_writable_cache()  # before `@njit(cache=True)` picks numba's cache directory

#: What is blended.
DELTAS, PAIR, MODELS, REBASED = 0, 1, 2, 3


@njit(cache=True, **OPTIONS)
def _blend_kernel(inputs, mode, factors, divide, divisor, add_base, from_zero, out, nan_bits):  # noqa: ANN001, ANN201
    """out[:] = the blend of `inputs` (base first) cast to out's dtype."""
    n, buf, vals, rows = tiles_of(inputs, TILE)
    res = np.empty(TILE, np.float32)
    term = np.empty(TILE, np.float32)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        if mode == MODELS:  # no task is measured against the base: no rounded rows
            load_tile(inputs, lo, m, buf)
        else:
            load_tile_bases(inputs, lo, m, buf)
        for t in range(factors.size):
            _term(vals, rows, m, mode, t, factors[t], term)
            _accumulate(term, m, t, from_zero, res)
        _finish(vals[0], m, divide, divisor, add_base, res)
        store_span(res[:m], out, lo, nan_bits)


@register_jitable
def _term(vals, rows, m, mode, t, f, term):  # noqa: ANN001, ANN202
    """term[:m] = vector t of a tile times its factor `f`: the task vector (`DELTAS`), the
    model (`MODELS`; `PAIR`: the base first) or the model measured against the base at its
    precision, on the base (`PAIR`, `REBASED`; their tiles hold the rounded bases,
    `load_tile_bases`). One vector at a time over the tile, so that each loop has no branch
    and vectorizes; each element's ops and their order are the eager rule's."""
    b = vals[0]
    k = t - 1 if mode == PAIR else t  # the task of vector t (PAIR: -1, the base)
    if mode == DELTAS:
        x, at = vals[t + 1], vals[rows[t]]
        for i in range(m):
            term[i] = (x[i] - at[i]) * f  # the eager rule's operand order (NaN payloads)
    elif mode == MODELS or k < 0 or rows[k] == 0:
        x = vals[k + 1]
        for i in range(m):
            term[i] = x[i] * f
    else:  # the model's update against the base at its precision, on the base
        x, at = vals[k + 1], vals[rows[k]]
        for i in range(m):
            term[i] = (b[i] + (x[i] - at[i])) * f


@register_jitable
def _accumulate(term, m, t, from_zero, res):  # noqa: ANN001, ANN202
    """res[:m] = the sum so far plus term t: `res + term`, or the first term (`from_zero`:
    `0 + term`, `linear`'s zero accumulator, where 0 + -0.0 is +0.0)."""
    zero = np.float32(0.0)
    if t > 0:
        for i in range(m):
            res[i] = res[i] + term[i]
    elif from_zero:
        for i in range(m):
            res[i] = zero + term[i]
    else:
        for i in range(m):
            res[i] = term[i]


@register_jitable
def _finish(b, m, divide, divisor, add_base, res):  # noqa: ANN001, ANN202
    """res[:m] = res / divisor, then b + res, where asked."""
    if divide:
        for i in range(m):
            res[i] = res[i] / divisor
    if add_base:
        for i in range(m):
            res[i] = b[i] + res[i]


def blend(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    mode: int,
    factors: Sequence[float],
    divisor: float | None = None,
    add_base: bool = False,
    from_zero: bool = False,
    bf16_nan: int | None = None,
) -> None:
    """Write the blend into `out` (the output's raw array: bfloat16 as uint16). `factors`
    and `divisor` are float32 values, one factor per vector (`mode`); `from_zero`: the sum
    is `((0 + f_0 x_0) + f_1 x_1) + ...`, `linear`'s order, not from `f_0 x_0`."""
    arrays, target, nan_bits, _ = merge_records(base, tasks, out, bf16_nan)
    vectors = 2 if mode == PAIR else len(arrays) - 1
    if len(factors) != vectors:
        raise ValueError(f"{len(factors)} factors for {vectors} vectors")
    _blend_kernel(
        arrays,
        mode,
        np.asarray(factors, np.float32),
        divisor is not None,
        np.float32(1.0 if divisor is None else divisor),
        add_base,
        from_zero,
        target,
        nan_bits,
    )


@njit(cache=True, **OPTIONS)
def _stock_kernel(inputs, ts, row, out, nan_bits):  # noqa: ANN001, ANN201
    """out[:] = model_stock's blend of `inputs` (base first) with `ts[k]` the ratio of the
    elements [k * row, (k + 1) * row), cast to out's dtype."""
    ntasks = len(inputs) - 1
    n, buf, vals, rows = tiles_of(inputs, TILE)
    total = np.empty(TILE, np.float32)
    res = np.empty(TILE, np.float32)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    count = np.float32(ntasks)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        b = vals[0]
        for k in range(ntasks):  # each model's value as `task_values` gives it
            x = vals[k + 1]
            if rows[k] != 0:
                at = vals[rows[k]]
                for i in range(m):
                    x[i] = b[i] + (x[i] - at[i])
        first = vals[1]
        for i in range(m):
            total[i] = first[i] + zero  # mergekit's `sum(ws)` starts from the int 0
        for k in range(1, ntasks):
            x = vals[k + 1]
            for i in range(m):
                total[i] = total[i] + x[i]
        at = lo
        while at < lo + m:  # runs of one row: one t
            r = at // row
            stop = min((r + 1) * row, lo + m)
            t = ts[r]
            s = one - t
            for i in range(at - lo, stop - lo):
                res[i] = t * (total[i] / count) + s * b[i]
            at = stop
        store_span(res[:m], out, lo, nan_bits)


def stock(
    base: ArrayLike,
    tasks: Sequence[ArrayLike],
    out: ArrayLike,
    *,
    ts: Sequence[float],
    row: int | None = None,
    bf16_nan: int | None = None,
) -> None:
    """Write model_stock's blend into `out` (the output's raw array: bfloat16 as uint16).
    `ts` are float32 values: one per `row` elements (None: one for all)."""
    arrays, target, nan_bits, n = merge_records(base, tasks, out, bf16_nan)
    size = n if row is None else row
    if len(ts) * max(size, 1) < n:
        raise ValueError(f"{len(ts)} ratios for {n} elements in rows of {size}")
    _stock_kernel(arrays, np.asarray(ts, np.float32), max(size, 1), target, nan_bits)


@njit(cache=True, **OPTIONS)
def _nearswap_kernel(inputs, t, floor, out, nan_bits):  # noqa: ANN001, ANN201
    """out[:] = nearswap's blend of the base and one model (`inputs`), cast to out's dtype."""
    n, buf, vals, rows = tiles_of(inputs, TILE)
    res = np.empty(TILE, np.float32)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for lo in range(0, n, TILE):
        m = min(TILE, n - lo)
        load_tile_bases(inputs, lo, m, buf)
        a_row, b_row, at = vals[0], vals[1], vals[rows[0]]
        rebased = rows[0] != 0
        for i in range(m):
            a = a_row[i]
            b = a + (b_row[i] - at[i]) if rebased else b_row[i]  # `task_values`
            d = abs(a - b)
            if d < floor:  # clamp(min=floor): NaN stays NaN
                d = floor
            w = (one / d) * t  # torch's `t / x`: reciprocal(x) * t
            if w < zero:  # clamp(0, 1): -0.0 and NaN stay as they are
                w = zero
            elif w > one:
                w = one
            res[i] = w * b + (one - w) * a
        store_span(res[:m], out, lo, nan_bits)


def nearswap(
    base: ArrayLike,
    task: ArrayLike,
    out: ArrayLike,
    *,
    t: float,
    floor: float,
    bf16_nan: int | None = None,
) -> None:
    """Write nearswap's blend into `out` (the output's raw array: bfloat16 as uint16); `t`
    and `floor` (the least distance) are rounded to float32, as torch does with scalars."""
    arrays, target, nan_bits, _ = merge_records(base, [task], out, bf16_nan)
    _nearswap_kernel(arrays, np.float32(t), np.float32(floor), target, nan_bits)


KERNELS = (_blend_kernel, _stock_kernel, _nearswap_kernel)


def warm_calls() -> Iterator[Call]:
    """The geometric methods' blend (its mode is a value: one signature) and model_stock's
    merge, once each (`kernels.warm`)."""
    from ram_dist.kernels.warm import sample

    base, agents, out = sample()
    mix = partial(blend, base, agents, out, mode=MODELS, factors=[1.0] * len(agents))
    yield _blend_kernel, "records", mix
    yield _stock_kernel, "records", partial(stock, base, agents, out, ts=[0.5])
    yield _nearswap_kernel, "records", partial(nearswap, base, agents[0], out, t=1.0, floor=1e-6)


share_compiles(globals())  # each signature compiled by one process per node (`shared_cache`)
