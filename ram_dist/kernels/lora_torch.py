"""The LoRA product of `kernels.lora` with torch on a device (a GPU worker's), by the spec's
rule: `P = sum_k coef[:, k] * basis[k, :]` in float32, k ascending from the k = 0 product,
each product and each addition its own elementwise op (rounded once each: eager torch fuses
no multiply into an add, and adding with `alpha` 1 is exact), then `base + s * P`. Not a
matrix multiply, whose blocking (and TF32) would change the bytes."""

from __future__ import annotations

import numpy as np


def values(
    base: np.ndarray,
    coef: np.ndarray,
    basis: np.ndarray,
    scale: np.float32,
    start: int,
    device: str,
) -> np.ndarray:
    """float32 `base[e] + scale * P[i, j]` for flat elements `start + e = (row0 + i) * cols +
    j` of a weight `basis.shape[1]` wide, e < base.size (`coef` [rows, r] from row `row0`,
    `basis` [r, cols], float32), computed on `device`; back in host memory."""
    import torch

    cols, n = basis.shape[1], base.size
    row0, row1 = start // cols, -(-(start + n) // cols)
    c = torch.from_numpy(np.ascontiguousarray(coef[: row1 - row0])).to(device)
    b = torch.from_numpy(np.ascontiguousarray(basis)).to(device)
    product = c[:, 0:1] * b[0:1, :]
    for k in range(1, b.shape[0]):
        product += c[:, k : k + 1] * b[k : k + 1, :]  # the product rounded, then the sum
    at = start - row0 * cols
    flat = product.reshape(-1)[at : at + n]
    s = torch.tensor(np.float32(scale), dtype=torch.float32, device=device)
    theta = torch.from_numpy(np.ascontiguousarray(base, dtype=np.float32)).to(device)
    return (theta + s * flat).cpu().numpy()
