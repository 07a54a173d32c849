"""The fused numba kernels give exactly the eager torch path's bytes.

References: `methods.ram.overlap_statistics` and `methods.ram.merge_ram(...).to(out_dtype)`,
on random sparse (RL-like) task vectors, on pools of edge values (eps, -0.0, subnormals,
inf, NaN payloads, rounding ties at the bf16 and fp16 overflow), in every supported input
and output dtype, mixed, and at lengths around the kernels' tile. Values built so that a
fused multiply-add would change the result check that none happened.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from ram_dist.kernels import fma_check, views  # noqa: E402
from ram_dist.kernels import ram_numba as kernels  # noqa: E402
from ram_dist.methods import ram  # noqa: E402

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
EPS = 1e-5
TILE = kernels.TILE
LENGTHS = (1, 7, 1025, 2 * TILE + 3)


def bits(x: torch.Tensor) -> np.ndarray:
    """The raw bytes of a tensor, for byte-for-byte comparison."""
    return x.contiguous().view(torch.uint8).numpy()


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    a, b = bits(got), bits(want)
    if not np.array_equal(a, b):
        width = got.element_size()
        diff = np.flatnonzero((a != b).reshape(-1, width).any(axis=1))
        i = int(diff[0])
        raise AssertionError(
            f"{diff.size} of {got.numel()} elements differ; first at {i}: "
            f"got {got[i].item()!r} ({a[i * width : (i + 1) * width].tobytes().hex()}), "
            f"want {want[i].item()!r} ({b[i * width : (i + 1) * width].tobytes().hex()})"
        )


def eager_merge(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float, lambdas: list[float]
) -> torch.Tensor:
    """`methods.ram.merge_ram`, on one thread and on inputs padded to a multiple of 8.

    torch widens float16 eight at a time with F16C (a NaN keeps its sign and payload) but
    the last `n % 8` elements of each thread's range with a scalar routine that turns every
    NaN into 0x7FFFFFFF, so the eager bytes of a NaN from a float16 input depend on where it
    sits. The kernels give the F16C bytes everywhere; padding (the rule is element-wise)
    makes torch do the same. Nothing else in the eager path depends on position."""
    n = base.numel()
    pad = -n % 8
    if pad:
        base, *tasks = (torch.cat([x, torch.zeros(pad, dtype=x.dtype)]) for x in (base, *tasks))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ram.merge_ram(base, tasks, eps, lambdas)[:n]
    finally:
        torch.set_num_threads(threads)


def check(
    base: torch.Tensor,
    tasks: list[torch.Tensor],
    out_dtypes: tuple[torch.dtype, ...],
    eps: float = EPS,
    lambdas: list[float] | None = None,
) -> None:
    """Both kernels against the eager path, for every output dtype given."""
    n = len(tasks)
    want = ram.overlap_statistics(base, tasks, eps)
    got = kernels.overlap_counts(base, tasks, eps)
    assert got.dtype == np.int64 and np.array_equal(got, want.numpy()), (got, want)
    direct, nonfinite = kernels.overlap_counts_nonfinite(base, tasks, eps, code_tasks=0)
    assert np.array_equal(direct, want.numpy())  # the other counting strategy
    assert nonfinite == [int((~torch.isfinite(x)).sum()) for x in (base, *tasks)]
    if lambdas is None:
        lambdas = [1.0 + 0.2 * math.sin(3.0 * t + 1.0) ** 2 for t in range(n)]  # not float32
    eager = eager_merge(base, tasks, eps, lambdas)
    for out_dtype in out_dtypes:
        out = torch.full(base.shape, 7.0, dtype=out_dtype)
        kernels.merge_ram(base, tasks, eps, lambdas, out)
        assert_same_bytes(out, eager.to(out_dtype))


# ---- inputs ------------------------------------------------------------------------------


def sparse_inputs(
    n: int, dtypes: tuple[torch.dtype, ...], seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A base and RL-like agents: sparse changes (densities ~3 %, 46 %, 54 %, ...) of sizes
    from below eps to large, each agent in its own dtype."""
    g = torch.Generator().manual_seed(seed)
    densities = (0.03, 0.46, 0.54, 0.2, 0.7, 0.1, 0.5, 0.9)
    base32 = torch.randn(n, generator=g) * 0.02
    base = base32.to(dtypes[0])
    tasks = []
    for t, dtype in enumerate(dtypes[1:]):
        mask = torch.rand(n, generator=g) < densities[t % len(densities)]
        scale = 10.0 ** torch.randint(-7, -1, (n,), generator=g).float()
        step = torch.randn(n, generator=g) * scale
        tasks.append((base.float() + torch.where(mask, step, 0.0)).to(dtype))
    return base, tasks


# Raw bit patterns per stored dtype: zeros, subnormals, extremes, inf, NaNs (quiet,
# signaling, negative, with payloads), ones and the neighbourhood of eps.
EDGE_BITS = {
    BF16: [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F7E, 0x7F80,
           0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FA5, 0x3F80, 0xBF80, 0x3728, 0x3727,
           0x3729, 0xB728, 0x477F, 0x4780],
    F16: [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
          0x7E00, 0xFE00, 0x7C01, 0xFD55, 0x7FFF, 0x3C00, 0xBC00, 0x00A8, 0x00A7, 0x80A8],
    F32: [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF,
          0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0xFF7F8000, 0x7F7E8000, 0x7F800000,
          0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF812345, 0x477FE000,
          0x477FEFFF, 0x477FF000, 0xC77FF000, 0x477FF001, 0x33000000, 0x33000001, 0x33400000,
          0x33C00000, 0x387FE000, 0x387FF000, 0x38800000, 0x3F800000, 0x3727C5AC, 0x3727C5AD,
          0x3727C5AB, 0xB727C5AC, 0x3F808000, 0x3F818000, 0x3F800001],
}  # fmt: skip
_RAW = {BF16: (np.uint16, np.int16), F16: (np.uint16, np.int16), F32: (np.uint32, np.int32)}


def from_bits(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding exactly these bit patterns."""
    unsigned, signed = _RAW[dtype]
    return torch.from_numpy(values.astype(unsigned).view(signed)).view(dtype)


def edge_inputs(
    n: int, dtypes: tuple[torch.dtype, ...], seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every input mixes edge patterns, random bit patterns and small moves of the base
    (so that ties, tau = 0, tau = +-eps and cancellations occur)."""
    rng = np.random.default_rng(seed)
    width = {BF16: 16, F16: 16, F32: 32}

    def pattern(dtype: torch.dtype) -> np.ndarray:
        pool = np.array(EDGE_BITS[dtype], dtype=np.uint64)
        edge = pool[rng.integers(0, pool.size, n)]
        noise = rng.integers(0, 1 << width[dtype], n, dtype=np.uint64)
        return np.where(rng.random(n) < 0.6, edge, noise)

    base = from_bits(pattern(dtypes[0]), dtypes[0])
    tasks = []
    for dtype in dtypes[1:]:
        own = from_bits(pattern(dtype), dtype)
        moved = base.float() + torch.from_numpy(
            rng.choice([0.0, EPS, -EPS, 2 * EPS, 1e-3, -0.5, 1e30], n).astype(np.float32)
        )
        pick = torch.from_numpy(rng.random(n) < 0.5)
        tasks.append(torch.where(pick, own, moved.to(dtype)))
    return base, tasks


# ---- byte equality on data -----------------------------------------------------------------

OUTS = (F32, BF16, F16, F64)
COMBOS = [
    (BF16, BF16, BF16, BF16),
    (F16, F16, F16, F16),
    (F32, F32, F32, F32),
    (BF16, F16, F32, BF16),
    (F32, BF16, BF16),
    (F16, BF16, F32, F16, BF16),
]


@pytest.mark.parametrize("dtypes", COMBOS, ids=lambda d: "-".join(str(x)[6:] for x in d))
@pytest.mark.parametrize("n", LENGTHS)
def test_sparse_agents(dtypes: tuple[torch.dtype, ...], n: int) -> None:
    base, tasks = sparse_inputs(n, dtypes, seed=n)
    check(base, tasks, OUTS)


@pytest.mark.parametrize("dtypes", COMBOS, ids=lambda d: "-".join(str(x)[6:] for x in d))
def test_edge_values(dtypes: tuple[torch.dtype, ...]) -> None:
    for seed in range(3):
        base, tasks = edge_inputs(3 * TILE + 11, dtypes, seed)
        check(base, tasks, OUTS)


@pytest.mark.parametrize("n_tasks", [1, 2, 5, 8, 10, 11])
def test_task_counts(n_tasks: int) -> None:
    """1..11 tasks: up to 10 the counting pass uses the bit-pattern histogram, above it the
    per-task increments (`check` runs both strategies anyway)."""
    base, tasks = sparse_inputs(TILE + 5, (BF16,) * (n_tasks + 1), seed=n_tasks)
    check(base, tasks, (BF16,))


def test_empty_chunk() -> None:
    base, tasks = sparse_inputs(0, (BF16, BF16, BF16), seed=0)
    check(base, tasks, (BF16, F32))


def test_ram_plus_lambdas_are_rounded_once() -> None:
    """Lambdas given in float64 are rounded to float32 once, as the eager path does."""
    base, tasks = sparse_inputs(2000, (BF16, BF16, BF16, BF16), seed=3)
    lambdas = [1.0 + 0.1 * min(1.3 / 0.7, 2.0), 1.0 + 0.1 / 3, 1 + 2**-25 + 2**-50]
    check(base, tasks, (F32, BF16), lambdas=lambdas)


# ---- individual rules -------------------------------------------------------------------


def test_eps_is_compared_in_float32() -> None:
    """torch compares a float32 tensor with a Python float after rounding the float to
    float32: with eps = 0.1 (float32 rounds up), tau = float32(0.1) is not a change."""
    eps = 0.1
    tau = np.float32(eps)
    assert float(tau) > eps  # a float64 comparison would count it
    assert not bool(torch.tensor([tau]).abs() > eps)  # torch's does not
    above = np.nextafter(tau, np.float32(1.0))
    base = torch.zeros(4, dtype=F32)
    tasks = [torch.tensor([tau, -tau, above, 0.0]), torch.tensor([tau, 0.0, 0.0, -above])]
    counts = kernels.overlap_counts(base, tasks, eps)
    assert counts[2].tolist() == [2, 2, 0]  # elements 0, 1 unchanged; 2, 3 changed once
    check(base, tasks, OUTS, eps=eps)


def test_negative_zero_base_is_kept() -> None:
    base = torch.tensor([-0.0, -0.0, 0.0], dtype=BF16)
    tasks = [torch.tensor([0.0, -0.0, -0.0], dtype=BF16), torch.zeros(3, dtype=BF16)]
    for out_dtype in OUTS:
        out = torch.empty(3, dtype=out_dtype)
        kernels.merge_ram(base, tasks, EPS, [1.0, 1.0], out)
        assert [math.copysign(1.0, v) for v in out.tolist()] == [-1.0, -1.0, 1.0]
    check(base, tasks, OUTS)


def test_overflow_to_bf16_inf() -> None:
    """Results just above bf16's largest value round to inf (ties to even), as torch does."""
    big = np.array([0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000, 0x7F7F0000], np.uint32).view(np.float32)
    base = torch.from_numpy(big.copy())
    tasks = [base.clone(), base.clone()]  # c = 0: the cast alone
    out = torch.empty(4, dtype=BF16)
    kernels.merge_ram(base, tasks, EPS, [1.0, 1.0], out)
    got = [v & 0xFFFF for v in out.view(torch.int16).tolist()]
    assert got == [0x7F7F, 0x7F80, 0x7F7E, 0x7F7F]  # below the tie, tie to inf, tie to even
    grown = torch.from_numpy(big + np.float32(2.0**104))  # c = 1: base + tau crosses the tie
    check(base, [grown, base.clone()], OUTS)


def test_nan_to_bf16_matches_torch() -> None:
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345], np.uint32).view(np.float32)
    base = torch.from_numpy(nans.copy())
    out = torch.empty(4, dtype=BF16)
    kernels.merge_ram(base, [base.clone(), base.clone()], EPS, [1.0, 1.0], out)
    assert_same_bytes(out, base.to(BF16))
    assert views.torch_bf16_nan() in (0xFFFF, 0x7FC0, -1)


def test_half_nan_widening_ignores_position() -> None:
    """A float16 NaN widens to the same quiet NaN (sign and payload kept) at every position
    and length, unlike torch's scalar tail (see `eager_merge`)."""
    nans = [0x7E00, 0xFE00, 0x7C01, 0x7D55, 0xFFFF]
    body = torch.tensor(nans * 8, dtype=torch.int32).to(torch.int16).view(F16).float()
    for n in range(1, 18):
        base = torch.tensor((nans * 4)[:n], dtype=torch.int32).to(torch.int16).view(F16)
        out = torch.empty(n, dtype=F32)
        kernels.merge_ram(base, [base.clone()], EPS, [1.0], out)
        assert_same_bytes(out, body[:n])


def test_every_half_and_bfloat16_pattern() -> None:
    """All 65536 fp16 and bf16 values as base (c = 0), widened and narrowed again."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for dtype in (F16, BF16):
        base = every.view(dtype)
        check(base, [base.clone(), base.clone()], OUTS)


def test_float32_rounding_positions() -> None:
    """float32 -> bf16 / fp16 rounding at every exponent: every high half-word with low
    bits just below, at and above each tie (bf16: bit 15; fp16 normal: bit 12)."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x3001, 0x7FFF, 0x8000,
            0x8001, 0xBFFF, 0xC000, 0xFFFF]  # fmt: skip
    values = (high[:, None] | np.array(lows, np.uint32)[None, :]).reshape(-1)
    base = torch.from_numpy(values.view(np.float32))
    check(base, [base.clone()], (BF16, F16, F32))


# ---- no fused multiply-add ----------------------------------------------------------------


def fma_sensitive_inputs() -> tuple[torch.Tensor, torch.Tensor, float]:
    """Elements with c = 1 where base = -round(lambda * tau): two roundings give exactly 0,
    one rounding (an FMA) gives lambda * tau's rounding error, which is never 0 here."""
    lam = float(np.float32(1.1))
    taus = np.float32(3.0) + np.arange(256, dtype=np.float32) * np.float32(0.0078125)
    inexact = [Fraction(lam) * Fraction(float(t)) != Fraction(float(np.float32(lam) * t))
               for t in taus]  # fmt: skip
    taus = taus[np.array(inexact)]
    assert taus.size > 100
    base = -(np.float32(lam) * taus).astype(np.float32)
    task = (base + taus).astype(np.float32)
    assert np.array_equal(task - base, taus)  # tau is exact
    for b, t in zip(base, taus, strict=True):  # an FMA would not cancel
        assert Fraction(float(b)) + Fraction(lam) * Fraction(float(t)) != 0
    return torch.from_numpy(base), torch.from_numpy(task), lam


def test_no_fma_in_results() -> None:
    base, task, lam = fma_sensitive_inputs()
    other = base.clone()  # unchanged, so c = 1 and lambda applies
    expect = (base.numpy() + (np.float32(lam) * (task - base).numpy())).astype(np.float32)
    assert not expect.any()  # numpy rounds twice: exactly 0
    for out_dtype in (F32, BF16, F16, F64):
        out = torch.empty(base.shape, dtype=out_dtype)
        kernels.merge_ram(base, [task, other], EPS, [lam, 1.0], out)
        assert not out.float().any(), out  # an FMA leaves the rounding error (~1e-7)
        assert_same_bytes(out, ram.merge_ram(base, [task, other], EPS, [lam, 1.0]).to(out_dtype))


def test_no_fma_in_compiled_code() -> None:
    """The kernels' code has no FMA for inputs of every dtype and every output dtype (one
    signature: inputs and output are records); and the check finds the FMA that fastmath
    makes. (`kernels.fma_instructions()` does the same for every signature a process has
    used.)"""
    from numba import njit

    base, tasks = sparse_inputs(100, (BF16, F16, F32), seed=1)
    arrays = views.kernel_inputs(base, tasks)
    eps = np.float32(EPS)
    counts = kernels._count_kernel
    hist, checks = np.zeros((3, 3), np.int64), np.zeros((2, 3), np.int64)  # the check too
    counts(arrays, eps, hist, np.zeros(3, np.int64), kernels.CODE_TASKS, checks)
    assert kernels.fma_findings(counts) == []
    merge = kernels._merge_kernel
    for out_dtype in OUTS:
        out = views.kernel_output(torch.empty(100, dtype=out_dtype), 100)
        merge(arrays, eps, np.array([1.1, 1.2], np.float32), out, 0xFFFF)
    assert len(merge.signatures) == 1  # records: one signature holds every dtype's loops
    assert kernels.fma_findings(merge) == []
    contracted = njit(fastmath=True)(lambda a, b, c: a * b + c)
    contracted(1.5, 2.5, 3.5)
    assert kernels.fma_findings(contracted)


def test_the_check_finds_an_fma_in_cached_machine_code(tmp_path, monkeypatch) -> None:
    """A kernel loaded from numba's disk cache has no IR to inspect: its cached object code,
    the machine code that runs, is read instead, and a fastmath kernel's FMA is found there
    (every x86-64 CPU the README supports has FMA)."""
    import importlib
    import shutil

    if shutil.which("objdump") is None and not os.environ.get("CI"):
        pytest.skip("no objdump (binutils): cached kernels are compiled afresh to be checked")
    (tmp_path / "fma_kernel.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True, fastmath=True)\n"
        "def contracted(a, b, c):\n    return a * b + c\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("fma_kernel")
    module.contracted(1.5, 2.5, 3.5)  # compiled here, and saved to the cache
    module = importlib.reload(module)  # a new dispatcher, which loads it from the cache
    module.contracted(1.5, 2.5, 3.5)
    (compiled,) = module.contracted.overloads.values()
    assert compiled.library._disable_inspection  # loaded: numba keeps no IR for it
    listing = fma_check.cached_disassembly(module.contracted, module.contracted.signatures[0])
    assert listing is not None and "vfmadd" in listing
    assert [f for f in kernels.fma_findings(module.contracted) if f.startswith("vfmadd")]
    # where the object code cannot be read, the check compiles the kernel afresh
    monkeypatch.setattr(fma_check.shutil, "which", lambda _: None)
    assert fma_check.cached_disassembly(module.contracted, compiled.signature.args) is None
    found = kernels.fma_findings(module.contracted)
    assert "fmul fast" in found and [f for f in found if f.startswith("vfmadd")]


# ---- API ---------------------------------------------------------------------------------


def test_numpy_views_of_stored_bytes() -> None:
    """Numpy views of stored bytes work too (bf16 as uint16, fp16 as float16), read-only."""
    base, tasks = sparse_inputs(999, (BF16, F16, F32), seed=5)
    arrays = [
        np.frombuffer(bits(base).tobytes(), np.uint16),
        np.frombuffer(bits(tasks[0]).tobytes(), np.float16),
        np.frombuffer(bits(tasks[1]).tobytes(), np.float32),
    ]
    assert np.array_equal(
        kernels.overlap_counts(arrays[0], arrays[1:], EPS),
        ram.overlap_statistics(base, tasks, EPS).numpy(),
    )
    out = np.empty(999, np.uint16)
    kernels.merge_ram(arrays[0], arrays[1:], EPS, [1.1, 1.0], out)
    want = ram.merge_ram(base, tasks, EPS, [1.1, 1.0]).to(BF16)
    assert np.array_equal(out, bits(want).view(np.uint16))


def test_unsupported_and_invalid() -> None:
    assert kernels.supports([BF16, F16, F32], F64)
    assert not kernels.supports([F64, F32])
    assert not kernels.supports([BF16], torch.int8)
    x = torch.zeros(4, dtype=BF16)
    with pytest.raises(TypeError, match=r"^fused RAM kernels do not handle torch.float64$"):
        kernels.overlap_counts(torch.zeros(4, dtype=F64), [x, x], EPS)
    with pytest.raises(ValueError, match=r"^base and tasks differ in length: \[4, 5\]$"):
        kernels.overlap_counts(x, [torch.zeros(5, dtype=BF16)], EPS)
    with pytest.raises(ValueError, match=r"^1 lambdas for 2 tasks$"):
        kernels.merge_ram(x, [x, x], EPS, [1.0], torch.empty(4, dtype=BF16))
    with pytest.raises(ValueError, match=r"^the output of a fused RAM kernel must be contiguous$"):
        kernels.merge_ram(x, [x], EPS, [1.0], torch.empty(8, dtype=BF16)[::2])
    with pytest.raises(ValueError, match=r"^out has 5 elements, the inputs 4$"):
        kernels.merge_ram(x, [x], EPS, [1.0], torch.empty(5, dtype=BF16))


@pytest.mark.parametrize("dtype", [BF16, F16, F32, F64])
def test_nonfinite_count_agrees_with_isfinite(dtype):
    """The raw-bits NaN/Inf sweep of the reduce pass counts what torch.isfinite rejects:
    NaN payloads of both signs, +-inf, and not the largest finite, subnormals or -0.0."""
    from ram_dist.kernels import scan_numba

    info = torch.finfo(dtype)
    edge = torch.tensor(
        [math.nan, -math.nan, math.inf, -math.inf, info.max, -info.max, info.tiny / 2, -0.0],
        dtype=dtype,
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5 * TILE + 11, generator=g).to(dtype)
    x[torch.randperm(x.numel(), generator=g)[:97]] = edge.repeat(13)[:97]
    assert scan_numba.nonfinite_count(x) == int((~torch.isfinite(x)).sum()) > 0
    assert scan_numba.nonfinite_count(x[::3]) == int((~torch.isfinite(x[::3])).sum())
    assert scan_numba.nonfinite_count(x[:0]) == 0
