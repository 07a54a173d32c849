"""The counter-based generator: exact bits, chunking invariance, independence, uniformity."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ram_dist.methods.generalized_task_arithmetic.rng import (
    BITS,
    mix64,
    random_bits,
    stream_key,
    uniform,
)

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

_GOLDEN = 0x9E3779B97F4A7C15


def _uniform(*stream: Any, device: str | None = None) -> torch.Tensor:
    """`uniform` of the draws `random_bits(seed, task, name, start, stop)`."""
    return uniform(random_bits(*stream, device=device))


def _reference_bits(seed: int, task: int, name: str, start: int, stop: int) -> list[int]:
    """The same draws with Python integers only: pins the bits on every device."""
    key = stream_key(seed, task, name)
    return [mix64(key + i * _GOLDEN) >> (64 - BITS) for i in range(start, stop)]


def test_bits_match_pure_python_reference() -> None:
    for seed, task, name, start in [(0, 0, "a", 0), (-5, 3, "model.layers.0.mlp", 2**33)]:
        got = random_bits(seed, task, name, start, start + 200).tolist()
        assert got == _reference_bits(seed, task, name, start, start + 200)


def test_chunking_invariance() -> None:
    n = 10_007
    whole = _uniform(7, 1, "w", 0, n)
    assert whole.dtype == torch.float32 and whole.shape == (n,)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        cuts = sorted(torch.randint(0, n + 1, (6,), generator=gen).tolist())
        bounds = [0, *cuts, n]
        parts = [_uniform(7, 1, "w", lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(parts), whole)
    singles = torch.cat([_uniform(7, 1, "w", i, i + 1) for i in range(100)])
    assert torch.equal(singles, whole[:100])


def test_determinism_and_range() -> None:
    a = _uniform(3, 2, "x", 0, 50_000)
    b = _uniform(3, 2, "x", 0, 50_000)
    assert torch.equal(a, b)
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert torch.equal(a * 2**BITS, (a * 2**BITS).round())  # multiples of 2**-24


def test_streams_differ() -> None:
    n = 4096
    ref = _uniform(1, 0, "layer.weight", 0, n)
    others = [
        _uniform(2, 0, "layer.weight", 0, n),
        _uniform(1, 1, "layer.weight", 0, n),
        _uniform(1, 0, "layer.bias", 0, n),
    ]
    for other in others:
        assert (other == ref).float().mean() < 0.01
        corr = torch.corrcoef(torch.stack([ref, other]))[0, 1]
        assert abs(float(corr)) < 0.1


def test_uniformity() -> None:
    n = 1_000_000
    u = _uniform(11, 0, "big", 0, n).double()
    assert abs(float(u.mean()) - 0.5) < 0.002
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    expected = n / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 40.0  # 9 degrees of freedom: p < 1e-5 above 40
    # Adjacent draws are not correlated.
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.005


def test_device_argument_on_cpu() -> None:
    assert torch.equal(_uniform(0, 0, "d", 5, 9, device="cpu"), _uniform(0, 0, "d", 5, 9))
    assert _uniform(0, 0, "d", 4, 4).numel() == 0
