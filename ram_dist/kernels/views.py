"""The arrays the fused kernels take, made from what their callers hand: the engine's numpy
views of stored bytes (`ram_dist.kernels.READS`, `WRITES`), FP8 inputs as their e4m3 bytes
and scales (`fp8.Fp8Values`), MXFP4 and packed INT inputs as their codes and scales
(`quantized.QuantizedValues`), or CPU torch tensors (tests and benchmarks), without
importing torch for the former."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ram_dist.kernels import READS, WRITES
from ram_dist.kernels.fp8 import Fp8Values
from ram_dist.kernels.primitives import NUMBA_ARRAYS
from ram_dist.kernels.quantized import FIELDS, QuantizedValues, kernel_tuple

ArrayLike = "torch.Tensor | np.ndarray"


def _numba_arrays(table: Mapping[str, type]) -> dict[np.dtype, np.dtype]:
    """numpy view of stored elements -> the array a kernel takes for it."""
    return {np.dtype(t): NUMBA_ARRAYS.get(np.dtype(t), np.dtype(t)) for t in table.values()}


_READ_ARRAYS = _numba_arrays(READS)
_WRITE_ARRAYS = _numba_arrays(WRITES)


def is_tensor(x: object) -> bool:
    """Whether `x` is a torch tensor, without importing torch (a worker on the fused path
    never does: the engine hands numpy arrays)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def kernel_view(x: ArrayLike | Fp8Values | QuantizedValues, writable: bool) -> Any:
    """The flat array a kernel reads (or, `writable`, writes), typed as the kernels expect;
    an FP8 or quantized input (read only) as the tuple `primitives.load_span` takes."""
    if isinstance(x, QuantizedValues):
        if writable:
            raise TypeError("fused kernels do not write MXFP4 or packed INT")
        return kernel_tuple(x)
    if isinstance(x, Fp8Values):
        if writable:
            raise TypeError("fused RAM kernels write FP8 through fp8.Fp8Target")
        bm, bn = x.block
        q = np.ascontiguousarray(x.q).reshape(-1).view(np.uint8)
        scales = np.ascontiguousarray(x.scales, dtype=np.float32).reshape(-1)
        if q.size % x.cols or scales.size < -(-q.size // (bm * x.cols)) * -(-x.cols // bn):
            raise ValueError(f"FP8 input of {q.size} bytes, {scales.size} scales: not whole "
                             f"rows of {x.cols} with a scale per {bm} x {bn} block")  # fmt: skip
        return (q, scales, int(x.cols), int(bm), int(bn))
    table, arrays = (WRITES, _WRITE_ARRAYS) if writable else (READS, _READ_ARRAYS)
    if isinstance(x, np.ndarray):  # the engine's case first: it is called once per block
        kind = arrays.get(x.dtype)
        if kind is None:
            raise TypeError(f"fused RAM kernels do not handle numpy {x.dtype} (bf16 is uint16)")
        if writable and not (x.flags.c_contiguous and x.flags.writeable):
            raise ValueError("the output of a fused RAM kernel must be contiguous and writable")
        return x.ravel().view(kind)
    if not is_tensor(x):
        raise TypeError(f"expected a torch tensor or numpy array, got {type(x).__name__}")
    import torch

    from ram_dist.dtypes import TORCH_TO_SAFETENSORS

    assert isinstance(x, torch.Tensor)
    if x.device.type != "cpu":
        raise TypeError(f"fused RAM kernels run on CPU tensors, got {x.device}")
    name = TORCH_TO_SAFETENSORS.get(x.dtype)
    if name not in table:
        raise TypeError(f"fused RAM kernels do not handle {x.dtype}")
    if not x.is_contiguous():
        if writable:
            raise ValueError("the output of a fused RAM kernel must be contiguous")
        x = x.contiguous()
    stored = x.reshape(-1).view(torch.uint8).numpy().view(table[name])  # bf16: no numpy dtype
    return stored.view(arrays[stored.dtype])


def kernel_inputs(
    base: ArrayLike | Fp8Values | QuantizedValues,
    tasks: Sequence[ArrayLike | Fp8Values | QuantizedValues],
) -> tuple[Any, ...]:
    """(base, task_1, ..., task_N) as the kernels read them, checked to be of one length."""
    if len(tasks) < 1:
        raise ValueError("fused RAM kernels need at least one task")
    arrays = (kernel_view(base, False),)
    arrays += tuple([kernel_view(x, False) for x in tasks])
    sizes = [input_size(a) for a in arrays]
    if any(n != sizes[0] for n in sizes):
        raise ValueError(f"base and tasks differ in length: {sizes}")
    return arrays


def input_size(kernel_input: Any) -> int:
    """Elements of an input as `kernel_view` makes it (an FP8 input's: its e4m3 bytes; a
    quantized input's: its values, the tuple's `size`)."""
    if isinstance(kernel_input, tuple):
        return int(kernel_input[9] if len(kernel_input) == FIELDS else kernel_input[0].size)
    return int(kernel_input.size)


def kernel_output(out: ArrayLike, size: int) -> np.ndarray:
    """The array a kernel writes into, checked to hold `size` elements (the inputs')."""
    target = kernel_view(out, True)
    if target.size != size:
        raise ValueError(f"out has {target.size} elements, the inputs {size}")
    return target


@functools.cache
def torch_bf16_nan() -> int:
    """What torch writes for a NaN cast to bfloat16 in a contiguous tensor in this process:
    0xFFFF on AVX2/AVX512 builds, 0x7FC0 on the scalar path; -1 when it keeps the sign and
    payload (a quiet NaN, as `vcvtneps2bf16` would)."""
    import torch

    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF], np.uint32)
    probe = torch.from_numpy(np.tile(nans, 13).view(np.float32))
    got = probe.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    values = {int(v) for v in got}
    if len(values) == 1:
        return values.pop()
    if all(int(g) == (int(v) >> 16) | 0x40 for g, v in zip(got, np.tile(nans, 13), strict=True)):
        return -1
    raise RuntimeError(f"unexpected NaN encoding of torch's bfloat16 cast: {sorted(values)}")
