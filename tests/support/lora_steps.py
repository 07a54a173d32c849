"""The LoRA product step by step in numpy float32 scalars: the kernel tests' reference
(`tests/kernels/test_lora_kernels.py`, `tests/kernels/test_lora_stored_bases.py`), written
from `../shared/spec/ram.md`'s fixed order: one rounding per step, k ascending, no FMA."""

from __future__ import annotations

import numpy as np


def product_by_hand(
    theta: np.ndarray, coef: np.ndarray, basis: np.ndarray, scale: np.float32, start: int
) -> np.ndarray:
    """`theta + scale * (coef @ basis)` over the flat elements [start, start + theta.size)
    of a [rows, cols] weight (`coef` from the first of those rows on): each product and sum
    rounded to float32, k ascending."""
    cols = basis.shape[1]
    row0 = start // cols
    out = np.empty(theta.size, np.float32)
    for e in range(theta.size):
        i, j = (start + e) // cols - row0, (start + e) % cols
        acc = np.float32(coef[i, 0] * basis[0, j])
        for k in range(1, basis.shape[0]):
            acc = np.float32(acc + np.float32(coef[i, k] * basis[k, j]))
        out[e] = np.float32(theta[e] + np.float32(scale * acc))
    return out
