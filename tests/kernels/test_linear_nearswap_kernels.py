"""`linear`'s and `nearswap`'s fused map pass (`kernels/blend_numba`: the blend from a zero
sum, and nearswap's kernel) give the eager rule's bytes (`merge_chunk` cast to the output
dtype) on every stored and output dtype, with -0.0, subnormals, infinities, weights that do
not sum to 1 and normalize on and off, and the values of numpy's float32 op by op; a few
elements are checked by hand. Their code's lack of FMA is checked in `test_blend_kernels.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_runs import stored

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork

pytest.importorskip("numba")

N = 5000  # more than one tile (4096)
OUT = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
RAW = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32,
       torch.float64: np.float64}  # fmt: skip
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(dtypes: tuple[torch.dtype, ...], seed: int) -> list[torch.Tensor]:
    """A base and tasks (dtypes[1:]) near it, with the edge cases at fixed places: -0.0 in
    every input, subnormals (each dtype's own), equal values, an infinity, and two models
    far from the base."""
    g = torch.Generator().manual_seed(seed)
    base32 = torch.randn(N, generator=g) * 0.05
    xs = [base32.to(dtypes[0])]
    for t, dtype in enumerate(dtypes[1:]):
        step = torch.randn(N, generator=g) * (1e-4, 1e-2, 0.3)[t % 3]
        xs.append((base32 + step).to(dtype))
    for x in xs:
        tiny = torch.finfo(x.dtype).tiny
        x[0] = -0.0
        x[1:4] = torch.tensor([tiny / 4, -tiny / 2, tiny * 3])  # subnormals
        x[4] = 1.5  # equal in every input
        x[5] = torch.randn(1, generator=g).item()
    xs[-1][6] = float("inf")
    xs[0][7] = float("-inf")
    return xs


def _fused_vs_eager(
    name: str, params: dict, xs: list[torch.Tensor], nan_sign: bool = True
) -> torch.Tensor:
    """The eager rule's values; asserts the fused map pass writes their bytes in every
    output dtype. Where two NaNs meet (nearswap of an infinite base and a narrower model:
    the model's value on the base is NaN, and so is its weight), which one's sign a product
    keeps is the compiled code's choice, and torch's vector loops differ: not `nan_sign`,
    the output is NaN where the eager rule's is, the sign aside."""
    method = get_method(name)
    assert method.fuses(params) and method.reads_stored
    base, *tasks = xs
    chunk = Chunk("w", 0, (N,))
    eager = method.merge_chunk(ChunkWork(chunk, params, {}), base, tasks)
    for out_dtype in OUT:
        out = np.empty(N, RAW[out_dtype])
        assert method.fused_merge(ChunkWork(chunk, params, {}), stored(xs), out)
        want = eager.to(out_dtype)
        nan = want.isnan().numpy()
        raw, bits = want.view(torch.uint8).numpy(), out.view(np.uint8)
        wide = bits.size // N
        keep = ~np.repeat(nan, wide) if not nan_sign else np.ones(bits.size, bool)
        assert np.array_equal(bits[keep], raw[keep]), (name, out_dtype)
        assert np.array_equal(
            np.isnan(out.astype(np.float32) if out.dtype != np.uint16 else _bf16(out)), nan
        ), (name, out_dtype)
    return eager


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(
    "dtypes",
    [(d, d, d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16, torch.float16)],
    ids=lambda ds: "-".join(str(d).removeprefix("torch.") for d in ds),
)
def test_fused_linear_gives_the_eager_bytes(dtypes, normalize):
    xs = _inputs(dtypes, seed=len(dtypes))
    n = len(xs) - 1
    weights = [0.7, -0.35, 1.3][:n]  # sum 1.65 (or 0.35)
    eager = _fused_vs_eager("linear", {"weight": weights, "normalize": normalize}, xs)
    assert eager[0].item() == 0.0 and not torch.signbit(eager[0])  # a sum of -0.0s from 0
    # numpy's float32, op by op: ((0 + x_1 w_1) + x_2 w_2 + ...) / ((0 + w_1) + w_2 + ...)
    acc, total = np.zeros(N, np.float32), np.float32(0)
    for x, w in zip(xs[1:], np.float32(weights), strict=True):
        acc, total = acc + x.float().numpy() * w, np.float32(total + w)
    want = acc / total if normalize else acc
    assert np.array_equal(eager.numpy().view(np.uint32), want.view(np.uint32))


def test_fused_linear_with_one_model_and_the_base_among_the_inputs():
    """One input (the base listed as the task, as mergekit allows): `(0 + w x) / w`."""
    (base,) = _inputs((torch.bfloat16,), seed=3)
    _fused_vs_eager("linear", {"weight": [0.3], "normalize": True}, [base, base.clone()])
    eager = _fused_vs_eager("linear", {"weight": [3.0], "normalize": False}, [base, base])
    assert eager[0].item() == 0.0 and not torch.signbit(eager[0])
    assert eager[4].item() == 4.5


@pytest.mark.parametrize("t", [0.3, 1e-4, 0.0, -0.0, 7.0])
@pytest.mark.parametrize(
    "dtypes",
    [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=lambda ds: "-".join(str(d).removeprefix("torch.") for d in ds),
)
def test_fused_nearswap_gives_the_eager_bytes(dtypes, t):
    xs = _inputs(dtypes, seed=7)
    eager = _fused_vs_eager("nearswap", {"t": t}, xs, nan_sign=dtypes[0] == dtypes[1])
    if dtypes[0] != dtypes[1]:
        return  # the task's update measured against the base at its precision
    # numpy's float32, op by op: w = clamp((1 / max(|a - b|, 1e-6)) * t, 0, 1)
    a, b = (x.float().numpy() for x in xs)
    one = np.float32(1)
    d = np.abs(a - b)
    d = np.where(d < np.float32(1e-6), np.float32(1e-6), d)
    w = (one / d) * np.float32(t)
    w = np.where(w < 0, np.float32(0), np.where(w > 1, one, w))
    want = w * b + (one - w) * a
    assert np.array_equal(eager.numpy().view(np.uint32), want.view(np.uint32))


def test_nearswap_by_hand():
    """A few elements computed by hand in float32: near the base (distance <= t) the
    model's value; farther, `w b + (1 - w) a` with `w = t / |a - b|`."""
    base = torch.tensor([1.0, 1.0, -2.0, 0.0], dtype=torch.float32)
    task = torch.tensor([1.25, 3.0, 2.0, -0.0], dtype=torch.float32)
    out = np.empty(4, np.float32)
    work = ChunkWork(Chunk("w", 0, (4,)), {"t": 0.5}, {})
    assert get_method("nearswap").fused_merge(work, stored([base, task]), out)
    # |a - b| = 0.25 <= 0.5: b; 2.0: w = 0.25, 0.75 + 0.25 * 3; 4.0: w = 0.125, -1.75 + 0.25
    assert out.tolist() == [1.25, 1.5, -1.5, 0.0]
