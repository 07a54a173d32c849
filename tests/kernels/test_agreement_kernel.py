"""The probe's fused kernel (`kernels.agreement_numba`) against the eager torch rule
(`methods.agreement.agreement_statistics`): the same integers (RAM's counts, pair counts,
sign agreement, |tau| sums per exponent) for inputs of every dtype, zeros, subnormals, ties
in sign, all-shared and all-unique chunks; and no FMA in its compiled code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stored_forms import BASES, bf16_agents

pytest.importorskip("numba")

from ram_dist.kernels import agreement_numba, ram_numba  # noqa: E402
from ram_dist.methods import agreement, ram  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-3


def assert_equal(base: torch.Tensor, tasks: list[torch.Tensor], eps: float = EPS) -> None:
    """The kernel's integers are the torch rule's, and so are its nonfinite counts."""
    hist, extra, counts, _ = agreement_numba.agreement_counts(
        base, tasks, eps, count_nonfinite=True
    )
    want_hist, want = agreement.agreement_statistics(base, tasks, eps)
    np.testing.assert_array_equal(hist, want_hist.numpy())
    for key, got in zip(agreement.KEYS, extra, strict=True):
        np.testing.assert_array_equal(got, want[key].numpy(), err_msg=key)
    finite = [int((~torch.isfinite(x.float())).sum()) for x in (base, *tasks)]
    assert counts == finite


def random_inputs(
    n: int, dtypes: tuple[torch.dtype, ...], seed: int, density: float = 0.5
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A base of dtypes[0] and tasks of the rest: each task changes about `density` of the
    elements, by either sign, some by less than EPS, some to exact zero, some subnormal."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g) * 0.05
    base[torch.rand(n, generator=g) < 0.05] = 0.0
    base[torch.rand(n, generator=g) < 0.05] = 1e-40  # a float32 subnormal
    base = base.to(dtypes[0])
    tasks = []
    for dtype in dtypes[1:]:
        step = torch.randn(n, generator=g) * 0.01
        step[torch.rand(n, generator=g) < 0.1] *= 1e-3  # below eps
        keep = torch.rand(n, generator=g) >= density
        x = base.float() + step
        x[keep] = base.float()[keep]
        zero = torch.rand(n, generator=g) < 0.03
        x[zero] = 0.0
        tasks.append(x.to(dtype))
    return base, tasks


DTYPES = [
    (BF16, BF16, BF16, BF16),
    (F32, BF16, F16, F32),
    (F16, F16, BF16),
    (BF16, F32, F16, BF16, F32, BF16),
    (F32, F32),
]


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("density", [0.2, 0.6])
def test_random_inputs(dtypes: tuple[torch.dtype, ...], density: float) -> None:
    base, tasks = random_inputs(10_000, dtypes, seed=len(dtypes), density=density)
    assert_equal(base, tasks)


def test_many_tasks_and_a_partial_tile() -> None:
    base, tasks = random_inputs(4096 + 37, (BF16,) * 12, seed=3, density=0.7)
    assert_equal(base, tasks)


def test_ties_in_sign_all_shared_and_all_unique() -> None:
    """Every task moves every element (all shared), the same way or not; then each element
    moved by one task only (all unique); then nothing changed; eps zero and negative."""
    n = 5000
    base = torch.zeros(n, dtype=F32)
    signs = torch.tensor([1.0, -1.0])[
        torch.randint(0, 2, (3, n), generator=torch.Generator().manual_seed(1))
    ]
    tasks = [(s * 0.5).to(dt) for s, dt in zip(signs, (F32, BF16, F16), strict=True)]
    assert_equal(base, tasks)  # all shared
    same = [torch.full((n,), 0.25, dtype=F32), torch.full((n,), 0.5, dtype=BF16)]
    assert_equal(base, same)  # all shared, all agreeing
    unique = [torch.zeros(n, dtype=F32) for _ in range(3)]
    for t, x in enumerate(unique):
        x[t::3] = (-1.0) ** t * 0.75
    assert_equal(base, unique)  # all unique
    assert_equal(base, [base.clone(), base.clone()])  # nothing changed
    assert_equal(base, [tasks[0], base.clone()], eps=0.0)
    assert_equal(base, [tasks[0], base.clone()], eps=-1.0)  # zero updates count as changes


def test_subnormal_and_nonfinite_updates() -> None:
    """|tau| subnormal (exponent bin 0), the smallest normals (bin 1: the implicit bit),
    huge, infinite; NaN never counts as a change."""
    tiny = torch.tensor(
        [1e-45, 3e-39, -2e-40, 0.0, 1.2e-38, -1.5e-38, 1e38, float("inf"), float("nan"), -5.0]
    )
    base = torch.zeros_like(tiny)
    assert_equal(base, [tiny, -tiny, tiny.flip(0)], eps=0.0)


@pytest.mark.parametrize("kind", sorted(BASES))
def test_stored_bases(kind: str) -> None:
    """An FP8, MXFP4 or INT4 base read as stored (its record) gives what the torch rule
    gives on its decoded values, with bf16 agents."""
    base = BASES[kind]()
    agents = bf16_agents(base, 3)
    hi = base.numel
    tasks = [torch.from_numpy(a.view(np.int16).copy()).view(BF16) for a in agents]
    hist, extra, _, _ = agreement_numba.agreement_counts(base.stored(0, hi), agents, EPS)
    want_hist, want = agreement.agreement_statistics(base.tensor(0, hi), tasks, EPS)
    np.testing.assert_array_equal(hist, want_hist.numpy())
    for key, got in zip(agreement.KEYS, extra, strict=True):
        np.testing.assert_array_equal(got, want[key].numpy(), err_msg=key)
    assert want[agreement.KEYS[0]][0].sum() > 0  # something changed


def test_matches_rams_counts_and_precision_check() -> None:
    """RAM's histogram, and the NaN/Inf counts and precision check RAM's count kernel gives
    (the check round of a float32 base), from the same sweep."""
    base, tasks = random_inputs(3000, (F32, BF16, F16, F32), seed=9)
    tasks[1][::7] = float("inf")
    hist, _, counts, checks = agreement_numba.agreement_counts(
        base, tasks, EPS, count_nonfinite=True, check=True
    )
    np.testing.assert_array_equal(hist, ram.overlap_statistics(base, tasks, EPS).numpy())
    _, want_counts, want_checks = ram_numba.overlap_counts_checked(base, tasks, EPS)
    assert counts == want_counts and counts[2] > 0
    np.testing.assert_array_equal(checks, want_checks)
    assert checks.any()


def test_no_fma_in_compiled_code() -> None:
    base, tasks = random_inputs(100, (BF16, F16, F32), seed=2)
    agreement_numba.agreement_counts(base, tasks, EPS, count_nonfinite=True, check=True)
    assert agreement_numba.fma_instructions() == []
