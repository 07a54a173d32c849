"""Per-row sums inside one chunk, for methods whose units hold whole rows (`whole_rows`).

A row here is what mergekit reduces over with `dim=-1`: a run of `shape[-1]` consecutive
elements (a 1-D tensor is one row). A chunk of a tensor that holds whole rows of its first
dimension holds whole runs of its last one, so these sums never cross a chunk. Dot products
(`product_sums`) are exact, on the CPU with Python's `math.fsum`, rounded once to float64;
other float64 sums may instead be added in a fixed pairwise order on the tensors' device
(`tree_sums`). Either way a row's sum is the same whatever the device, the split or the
order units finish in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ram_dist.methods import exact_sums

if TYPE_CHECKING:
    import torch


def row_length(shape: tuple[int, ...]) -> int:
    """Elements in one row of a tensor of this shape (mergekit's `dim=-1`)."""
    return shape[-1] if shape and shape[-1] > 0 else 1


def fsum(values: list[float]) -> float:
    """math.fsum, with an infinite sum of both signs as NaN (where fsum raises)."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):
        if any(v != v for v in values) or (math.inf in values and -math.inf in values):
            return math.nan
        return math.inf if math.inf in values else -math.inf


def tree_sums(values: torch.Tensor, length: int) -> torch.Tensor:
    """float64 sums of each row of `values` (flat, whole rows of `length`) in a fixed
    pairwise order: each row padded with zeros to a power of two, then its halves added
    until one element is left. Every step is one element-wise IEEE addition, so the bits
    are the same on any device; the error is a few float64 ulps of the row's absolute sum
    (for arcee_fusion's softmax denominators and KL sums, which feed float32 results)."""
    import torch

    x = values.to(torch.float64).reshape(-1, length)
    width = 1 << max(length - 1, 0).bit_length()
    if width != length:
        x = torch.nn.functional.pad(x, (0, width - length))
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x.reshape(-1)


def float64_sums(values: torch.Tensor, length: int) -> list[float]:
    """The exact sum of each row of float64 `values` (flat, whole rows of `length`),
    rounded once to float64."""
    import torch

    rows = values.to(torch.float64).reshape(-1, length).cpu().tolist()
    return [fsum(row) for row in rows]


def product_sums(x: torch.Tensor, y: torch.Tensor | None, length: int) -> list[float]:
    """Per row, the exact sum of the float32 products x * y (x * x without y)."""
    import torch

    a = x.to(torch.float32).reshape(-1).to(torch.float64)
    b = a if y is None else y.to(torch.float32).reshape(-1).to(torch.float64)
    return float64_sums(a * b, length)  # each product exact in float64


def gram_rows(
    vectors: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]], length: int
) -> list[list[float]]:
    """Per row, the exact sums of the float32 products `vectors[i] * vectors[j]` for each
    pair: numba's `exact_sums.row_gram` where installed (bins, read back exactly), else
    `math.fsum` row by row; the same floats either way."""
    import numpy as np
    import torch

    arrays = np.stack([v.to(torch.float32).reshape(-1).cpu().numpy() for v in vectors])
    stats = exact_sums.row_gram(arrays, list(pairs), length)
    if stats is None:
        columns = [
            product_sums(vectors[i], None if i == j else vectors[j], length) for i, j in pairs
        ]
        return [list(row) for row in zip(*columns, strict=True)]
    return [[exact_sums.value(stat) for stat in row] for row in stats]
