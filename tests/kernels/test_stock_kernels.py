"""model_stock's fused map pass (`blend_numba.stock`, its `fused_merge`) gives the eager
rule's bytes (`merge_chunk` cast to the output dtype): one ratio per tensor and filter_wise's
ratio per row, every stored dtype (mixed ones measured against the base at each task's
precision), every output dtype, chunks of several sizes around the kernels' tile. (Its
compiled code is checked for fused multiply-adds with the blend's: test_blend_kernels.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from kernel_runs import run, run_rows, sparse_inputs, stored  # noqa: E402

from ram_dist.kernels import blend_numba, primitives  # noqa: E402
from ram_dist.methods import get_method  # noqa: E402
from ram_dist.methods.protocol import (
    Chunk,  # noqa: E402
    ChunkWork,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TILE = primitives.TILE
DTYPE_SETS = [(BF16, BF16, BF16, BF16), (F32, BF16, F16, F32), (F16, F16, F16)]


def bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).numpy()


def edged(base: torch.Tensor, tasks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tasks with a signed zero and values whose sum overflows (no infinity or NaN input:
    an inf makes t NaN, and which of two NaNs' payloads an operation keeps is the compiled
    code's choice)."""
    tasks = [t.clone() for t in tasks]
    tasks[0][0] = -0.0
    tasks[0][1] = torch.finfo(tasks[0].dtype).max
    tasks[1][1] = torch.finfo(tasks[1].dtype).max
    return tasks


def assert_same(fused, eager) -> None:
    (got, state_f, _), (want, state_e, _) = fused, eager
    assert state_f == state_e
    diff = np.flatnonzero(bits(got) != bits(want))
    assert np.array_equal(bits(got), bits(want)), (diff[:5], got[:8], want[:8])


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32, torch.float64])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_model_stock_fused_map_is_eager(dtypes, out_dtype, edges) -> None:
    n = 2 * TILE + 77
    base, tasks = sparse_inputs(n, dtypes, seed=len(dtypes))
    tasks = edged(base, tasks) if edges else tasks
    for bounds in ([0, n], [0, 5, TILE + 3, n]):
        fused = run(
            "model_stock",
            {"filter_wise": False},
            base,
            tasks,
            bounds,
            True,
            out_dtype,
            as_stored=True,
        )
        eager = run(
            "model_stock",
            {"filter_wise": False},
            base,
            tasks,
            bounds,
            False,
            out_dtype,
            as_stored=True,
        )
        assert_same(fused, eager)


@pytest.mark.parametrize("edges", [False, True])
@pytest.mark.parametrize("dtypes", DTYPE_SETS)
def test_model_stock_filter_wise_fused_map_is_eager(dtypes, edges) -> None:
    shape = (40, 211)  # rows that cross the tile's ends
    base, tasks = sparse_inputs(40 * 211, dtypes, seed=7)
    tasks = edged(base, tasks) if edges else tasks
    params = {"filter_wise": True}
    for rows in ([0, 40], [0, 1, 23, 40]):
        for out_dtype in (BF16, F32):
            fused = run_rows(
                "model_stock", params, base, tasks, shape, rows, True, out_dtype, as_stored=True
            )
            eager = run_rows(
                "model_stock", params, base, tasks, shape, rows, False, out_dtype, as_stored=True
            )
            assert_same(fused, eager)


def test_model_stock_one_dimensional_filter_wise_is_one_row() -> None:
    method = get_method("model_stock")
    base, tasks = sparse_inputs(300, (BF16, BF16, BF16), seed=2)
    params = {"filter_wise": True}
    assert method.fuses(params) and method.fuses({"filter_wise": False})
    chunk = Chunk("w", 0, (300,))
    state = method.initial_state({"w": params}, {"w": 300}, 2)
    want = method.merge_chunk(ChunkWork(chunk, params, state), base, tasks).to(BF16)
    out = torch.empty(300, dtype=BF16)
    assert method.fused_merge(ChunkWork(chunk, params, state), stored([base, *tasks]), out)
    assert np.array_equal(bits(out), bits(want))


def test_stock_takes_one_ratio_per_row() -> None:
    """The kernel against numpy's float32 arithmetic, op by op, on hand-picked ratios."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(3 * 1000).astype(np.float32)
    tasks = [rng.standard_normal(base.size).astype(np.float32) for _ in range(3)]
    ts = np.array([0.25, -1.5, 0.7], np.float32)
    out = np.empty_like(base)
    blend_numba.stock(base, tasks, out, ts=list(ts), row=1000)
    total = ((tasks[0] + np.float32(0)) + tasks[1]) + tasks[2]
    t = np.repeat(ts, 1000)
    want = t * (total / np.float32(3)) + (np.float32(1) - t) * base
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="2 ratios"):
        blend_numba.stock(base, tasks, out, ts=[0.5, 0.5], row=1000)
