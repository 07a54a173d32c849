"""compressed-tensors' `pack-quantized` INT4/INT8 weight as a `TensorSource`
(`planning.sources`): what a unit reads of it and how the bytes become its values
(`kernels.int_packed`).

A row's codes start at its first word, so a unit or a compute block cuts such a weight only
between rows (`atomic_rows` 1). The values are decoded in the scale's dtype (bfloat16 for
every published checkpoint), as compressed-tensors decodes them, so a bf16 agent's untouched
elements equal them; the fused kernels read the words and scales as stored (`encoded`,
`MergeMethod.reads_stored`), decoding each value as they load it. The planned bytes are one
per element (half a byte of codes and the scales, rounded up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ram_dist.dtypes import INFO, itemsize
from ram_dist.errors import CheckpointError
from ram_dist.kernels import int_packed, quantized
from ram_dist.planning.sources import Range


class PackedIntSource(NamedTuple):
    """`<name>_packed` (int32 words) with `<name>_scale`, the optional `<name>_zero_point`
    and `<name>_shape`, whose values are the [rows, cols] tensor `name`. `groups` scales per
    row (1 per channel), or 0 for one scale of the whole tensor; a zero point's dtype is ""
    where there is none."""

    file: str
    start: int
    """Where `<name>_packed` lies."""
    dtype: str
    name: str
    scale_file: str
    scale_start: int
    scale_dtype: str
    zero_file: str
    zero_start: int
    zero_dtype: str
    shape_file: str
    shape_start: int
    shape_dtype: str
    bits: int
    rows: int
    cols: int
    groups: int

    @property
    def itemsize(self) -> int:
        return 1

    @property
    def values_dtype(self) -> str:
        return self.scale_dtype

    @property
    def decoded(self) -> bool:
        return True

    @property
    def atomic_rows(self) -> int | None:
        return 1

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The rows' words, then their scales and zero points (per row or group)."""
        assert start % self.cols == 0, f"{self.file}: a packed weight not cut at a row"
        first, last = start // self.cols, -(-stop // self.cols)
        row = int_packed.words_per_row(self.cols, self.bits) * 4
        out = [(self.file, self.start + first * row, self.start + last * row)]
        if self.groups:
            width = self.groups * itemsize(self.scale_dtype)
            out.append(
                (self.scale_file, self.scale_start + first * width, self.scale_start + last * width)
            )
            if self.zero_dtype:
                p0, p1 = int_packed.zero_rows(first, last, self.bits)
                width = self.groups * 4
                out.append(
                    (self.zero_file, self.zero_start + p0 * width, self.zero_start + p1 * width)
                )
        return out

    def unit_ranges(self) -> list[Range]:
        """`<name>_shape`, checked against the packed words, and a tensor's one scale and
        zero point."""
        out = [
            (self.shape_file, self.shape_start, self.shape_start + 2 * itemsize(self.shape_dtype))
        ]
        if not self.groups:
            out.append(
                (self.scale_file, self.scale_start, self.scale_start + itemsize(self.scale_dtype))
            )
            if self.zero_dtype:
                out.append(
                    (self.zero_file, self.zero_start, self.zero_start + itemsize(self.zero_dtype))
                )
        return out

    def encoded(
        self, start: int, stop: int, read: Sequence[np.ndarray]
    ) -> quantized.QuantizedValues:
        """The rows' words, scales and zero points as the kernels read them, decoding each
        value as they load it (`kernels.quantized`): no copy of the values."""
        words, rows, scales, zeros = self._parts(start, stop, read)
        return quantized.int_values(
            words, self.bits, rows, self.cols, scales, zeros, self.scale_dtype
        )  # fmt: skip

    def decode(
        self,
        start: int,
        stop: int,
        read: Sequence[np.ndarray],
        floats: Callable[[int], np.ndarray],
        base: np.ndarray,
    ) -> np.ndarray:
        """The rows' values in `values_dtype`, as bytes (`kernels.int_packed.decode`)."""
        words, rows, scales, zeros = self._parts(start, stop, read)
        return int_packed.decode_in(
            words, self.bits, rows, self.cols, scales, zeros, self.scale_dtype,
            floats(rows * self.cols),
        )  # fmt: skip

    def _parts(
        self, start: int, stop: int, read: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray | None]:
        """The rows' words (bytes), their count, their scales (float32 [rows or 1, G]) and
        zero points (int16, the same shape; None without), from what `ranges` and
        `unit_ranges` read (`<name>_shape` checked on the way)."""
        first, last = start // self.cols, -(-stop // self.cols)
        rows = last - first
        arrays = list(read)
        words = arrays.pop(0)
        if self.groups:
            scales = int_packed.scale_floats(arrays.pop(0), self.scale_dtype)
            zeros = None
            if self.zero_dtype:
                p0, _ = int_packed.zero_rows(first, last, self.bits)
                column = int_packed.unpack_columns(arrays.pop(0), self.bits, self.groups)
                at = first - p0 * 32 // self.bits
                zeros = column[at : at + rows]
            self._check_shape(arrays.pop(0))
        else:
            self._check_shape(arrays.pop(0))
            scales = int_packed.scale_floats(arrays.pop(0), self.scale_dtype)
            raw = arrays.pop(0) if self.zero_dtype else None
            zeros = None if raw is None else raw.view(INFO[self.zero_dtype].numpy)[:1]
        one = self.groups or 1
        z = None if zeros is None else zeros.reshape(-1, one).astype(np.int16)
        return words, rows, scales.reshape(-1, one), z

    def _check_shape(self, raw: np.ndarray) -> None:
        """`<name>_shape` must say the shape the packed words and scales give."""
        shape = [int(v) for v in raw.view(INFO[self.shape_dtype].numpy)[:2]]
        if shape != [self.rows, self.cols]:
            raise CheckpointError(
                f"tensor {self.name + '_shape'!r} in {self.shape_file} says {shape}, but "
                f"{self.name + '_packed'!r} and its scales hold [{self.rows}, {self.cols}] "
                f"({self.bits}-bit codes): the checkpoint does not agree with itself; save "
                "it again with compressed-tensors, or dequantize it"
            )
