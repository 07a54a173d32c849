"""The geometric methods' fused blend (`kernels/blend_numba`, their `fused_merge`) gives the
eager rule's bytes (`merge_chunk` cast to the output dtype) for every method, stored dtype
and output dtype, and its compiled code holds no fused multiply-add."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals

pytest.importorskip("numba")

SHAPE = (37, 29)
CASES = {
    "slerp": (1, {"t": 0.3}),
    "nuslerp": (2, {"weight": [0.3, 0.9], "nuslerp_flatten": True, "nuslerp_row_wise": False}),
    "multislerp": (3, {"weight": [0.3, 0.9, 0.5], "normalize_weights": True, "eps": 1e-8}),
    "multislerp-one": (1, {"weight": [0.3], "normalize_weights": True, "eps": 1e-8}),
    "karcher": (3, {"max_iter": 10, "tol": 1e-5}),
}
OUT = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32,
       torch.float64: np.float64}  # fmt: skip


def _raw(x: torch.Tensor) -> np.ndarray:
    flat = x.reshape(-1)
    return flat.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else flat.numpy()


@pytest.mark.parametrize("infinite", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_blend_gives_the_eager_bytes(case, dtype, infinite):
    n, params = CASES[case]
    method = get_method(case.split("-")[0])
    gen = torch.Generator().manual_seed(len(case))
    base = torch.randn(SHAPE, generator=gen).to(dtype)
    tasks = [(base.float() + 0.5 * torch.randn(SHAPE, generator=gen)).to(dtype) for _ in range(n)]
    tasks[0].reshape(-1)[0] = -0.0
    if infinite:  # every factor NaN (a NaN input is left out: which of two NaNs' payloads
        # a product keeps is the compiled code's choice, and torch's vector loops differ)
        tasks[0].reshape(-1)[1] = float("inf")
    chunk = Chunk("w", 0, SHAPE)
    flat_base, flat_tasks = base.reshape(-1), [t.reshape(-1) for t in tasks]
    state = method.initial_state({"w": params}, {"w": base.numel()}, n)
    if method.active(0, state, "w"):
        total = method.chunk_statistics(ChunkWork(chunk, params, state, 0), flat_base, flat_tasks)[
            "w"
        ]
        state = method.finalize(
            RoundTotals(0, {"w": total}, {"w": params}, {"w": base.numel()}, state)
        )
    eager = method.merge_chunk(ChunkWork(chunk, params, state), flat_base, flat_tasks)
    assert method.fuses(params)
    for out_dtype, kind in OUT.items():
        out = np.empty(base.numel(), kind)
        assert method.fused_merge(
            ChunkWork(chunk, params, state), [_raw(base), *map(_raw, tasks)], out
        )
        want = eager.to(out_dtype).contiguous().view(torch.uint8).numpy()
        assert np.array_equal(out.view(np.uint8), want), out_dtype


def test_nuslerp_rows_and_columns_decline_the_fused_blend():
    method = get_method("nuslerp")
    for row_wise in (False, True):
        params = {"weight": [1.0, 1.0], "nuslerp_flatten": False, "nuslerp_row_wise": row_wise}
        assert not method.fuses(params)
        out = np.empty(4, np.float32)
        x = np.zeros(4, np.float32)
        assert not method.fused_merge(ChunkWork(Chunk("w", 0, (2, 2)), params, {}), [x, x, x], out)


def test_no_fused_multiply_add_in_the_blend():
    """No FMA in the kernels' (the blend's, model_stock's and nearswap's) code, for every
    signature this process has used (`fma_check.fma_findings`)."""
    from ram_dist.kernels import blend_numba, fma_check

    x = np.ones(64, np.float32)
    out = np.empty(64, np.float32)
    blend_numba.blend(x, [x, x], out, mode=blend_numba.DELTAS, factors=[0.5, 0.25],
                      divisor=3.0, add_base=True)  # fmt: skip
    blend_numba.stock(x, [x, x], out, ts=[0.5])  # model_stock's
    blend_numba.nearswap(x, x, out, t=0.5, floor=1e-6)  # nearswap's
    for kernel in blend_numba.KERNELS:
        assert kernel.signatures and fma_check.fma_findings(kernel) == [], kernel
