"""What the fused kernels take, made from what their callers hand: the engine's numpy views
of stored bytes (`ram_dist.kernels.READS`, `WRITES`), FP8 inputs as their e4m3 bytes and
scales (`fp8.Fp8Values`), MXFP4 and packed INT inputs as their codes and scales
(`quantized.QuantizedValues`), or CPU torch tensors (tests and benchmarks), without
importing torch for the former.

Each becomes a record (`primitives.FIELDS` int64: its kind, values' dtype, size, arrays'
addresses and byte counts, a quantized format's parameters), and the inputs one table of
them: a kernel's numba type is then the same whatever the dtypes, formats and task count,
so each kernel compiles once (numba compiles per combination of argument types: typed
arrays and tuples of inputs made 1379 specializations to warm). The table holds the
arrays its addresses point into, so they live as long as it does."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ram_dist.kernels import READS, WRITES
from ram_dist.kernels.fp8 import Fp8Values
from ram_dist.kernels.primitives import (
    BF16,
    BITS,
    BM,
    BN,
    COLS,
    DATA,
    F16,
    F32,
    F64,
    FIELDS,
    FORMAT,
    FP8,
    GROUPS,
    KEY,
    KIND,
    NUMBA_ARRAYS,
    PANEL,
    QUANTIZED,
    ROWS,
    SCALES,
    SIZE,
    VALUES,
    ZEROS,
)
from ram_dist.kernels.quantized import FIELDS as QUANTIZED_FIELDS
from ram_dist.kernels.quantized import MARKERS, QuantizedValues, kernel_tuple

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
    """The flat array of an input (or, `writable`, the output) that its record points into,
    as the kernels read it; an FP8 or quantized input (read only) as a tuple of its arrays
    and parameters."""
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
) -> np.ndarray:
    """(base, task_1, ..., task_N) as the kernels read them, checked to be of one length:
    an int64 table, a record per input (`primitives.FIELDS`: its kind, values' dtype, size,
    arrays' addresses and parameters), which keeps the arrays it points into alive. One
    numba type for every dtype, format and task count: each kernel compiles once."""
    if len(tasks) < 1:
        raise ValueError("fused RAM kernels need at least one task")
    arrays = [kernel_view(base, False)] + [kernel_view(x, False) for x in tasks]
    sizes = [_size(a) for a in arrays]
    if any(n != sizes[0] for n in sizes):
        raise ValueError(f"base and tasks differ in length: {sizes}")
    return _Records([_record(a) for a in arrays], arrays).table()


def kernel_output(out: ArrayLike, size: int) -> np.ndarray:
    """The record of the array a kernel writes into (`kernel_record`), checked to hold
    `size` elements (the inputs')."""
    target = kernel_record(out, True)
    if target[SIZE] != size:
        raise ValueError(f"out has {target[SIZE]} elements, the inputs {size}")
    return target


class MergeRecords(NamedTuple):
    """What a kernel that writes a merge takes from its wrapper (`merge_records`)."""

    inputs: np.ndarray
    out: np.ndarray
    nan_bits: int
    size: int


def merge_records(
    base: ArrayLike | Fp8Values | QuantizedValues,
    tasks: Sequence[ArrayLike | Fp8Values | QuantizedValues],
    out: ArrayLike,
    bf16_nan: int | None,
) -> MergeRecords:
    """The inputs' table (`kernel_inputs`), the output's record checked to hold as many
    elements, the bits of a NaN cast to bfloat16 (`bf16_nan`, else what torch writes here:
    the engine passes what it probed on the driver, so that workers need no torch), and the
    element count: what every wrapper of a kernel that writes a merge starts from."""
    arrays = kernel_inputs(base, tasks)
    size = input_size(arrays[0])
    nan_bits = torch_bf16_nan() if bf16_nan is None else bf16_nan
    return MergeRecords(arrays, kernel_output(out, size), nan_bits, size)


def kernel_record(x: ArrayLike | Fp8Values | QuantizedValues, writable: bool) -> np.ndarray:
    """One input's (or, `writable`, the output's) record, as a row of `kernel_inputs`'
    table, which keeps what it points into alive."""
    view = kernel_view(x, writable)
    return _Records([_record(view)], [view]).table()[0]


def input_size(record: np.ndarray) -> int:
    """Elements of an input or output record (`kernel_inputs`' rows, `kernel_output`)."""
    return int(record[SIZE])


class _Records:
    """An int64 table of records whose numpy array holds the arrays its addresses point
    into (numpy keeps the `__array_interface__` provider as the array's base), so that
    they live as long as the table, whoever holds it."""

    def __init__(self, rows: list[list[int]], keep: list[Any]) -> None:
        self._table = np.array(rows, np.int64).reshape(len(rows), FIELDS)
        self.keep = keep
        self.__array_interface__ = self._table.__array_interface__

    def table(self) -> np.ndarray:
        return np.asarray(self)


_KINDS = {
    np.dtype(np.uint16): BF16, np.dtype(np.int16): F16, np.dtype(np.float32): F32,
    np.dtype(np.float64): F64,
}  # fmt: skip
_MARKER_KINDS = {np.dtype(t): _KINDS[np.dtype(NUMBA_ARRAYS.get(np.dtype(t), np.dtype(t)))]
                 for t in MARKERS.values()}  # fmt: skip


def _address(a: np.ndarray) -> tuple[int, int]:
    """(address, bytes) of a contiguous array, a record's array field."""
    if not a.flags.c_contiguous:
        raise ValueError("a kernel record's arrays must be contiguous")
    return (a.__array_interface__["data"][0] if a.size else 0), a.nbytes


def _size(view: Any) -> int:
    """Elements of an input as `kernel_view` makes it."""
    if isinstance(view, tuple):
        return int(view[9] if len(view) == QUANTIZED_FIELDS else view[0].size)
    return int(view.size)


def _record(view: Any) -> list[int]:
    """The record (`primitives.FIELDS` int64) of an input or output as `kernel_view` makes
    it: a flat array, an FP8 input's tuple or a quantized input's."""
    rec = [0] * FIELDS
    rec[KEY] = -1
    if isinstance(view, tuple) and len(view) == QUANTIZED_FIELDS:
        marker, codes, scales, zeros, fmt, nbits, rows, cols, groups, size, panel, _ = view
        rec[KIND], rec[VALUES], rec[SIZE] = QUANTIZED, _MARKER_KINDS[marker.dtype], size
        rec[DATA : DATA + 2] = _address(codes)
        rec[SCALES : SCALES + 2] = _address(scales)
        rec[ZEROS : ZEROS + 2] = _address(zeros)
        rec[PANEL : PANEL + 2] = _address(panel)
        rec[FORMAT], rec[BITS], rec[ROWS], rec[COLS], rec[GROUPS] = fmt, nbits, rows, cols, groups
    elif isinstance(view, tuple):
        q, scales, cols, bm, bn = view
        rec[KIND], rec[VALUES], rec[SIZE] = FP8, F32, q.size
        rec[DATA : DATA + 2] = _address(q)
        rec[SCALES : SCALES + 2] = _address(scales)
        rec[COLS], rec[BM], rec[BN] = cols, bm, bn
    else:
        rec[KIND] = rec[VALUES] = _KINDS[view.dtype]
        rec[SIZE] = view.size
        rec[DATA : DATA + 2] = _address(view)
    return rec


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
