"""compressed-tensors' `pack-quantized` INT4/INT8 weight as a `TensorSource`
(`planning.sources`): what a unit reads of it and how the bytes become its values
(`kernels.int_packed`).

A row's codes start at its first word, so a unit or a compute block cuts such a weight only
between rows (`atomic_rows` 1). The values are decoded in the scale's dtype (bfloat16 for
every published checkpoint), as compressed-tensors decodes them, so a bf16 agent's untouched
elements equal them; the fused kernels read the words and scales as stored (`encoded`,
`MergeMethod.reads_stored`), decoding each value as they load it. The planned bytes are what
is read: the words, scales and zero points together, over the elements (`itemsize`: 0.5625
for INT4 groups of 32 with bf16 scales).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ram_dist.dtypes import INFO, itemsize
from ram_dist.errors import CheckpointError
from ram_dist.kernels import int_packed, quantized
from ram_dist.planning.sources import Arrays, Base, Floats, Range, SourceDefaults

if TYPE_CHECKING:
    from ram_dist.io.checkpoint import Checkpoint
    from ram_dist.io.storage import Buffer, Storage


class _PackedIntFields(NamedTuple):
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


class PackedIntSource(_PackedIntFields, SourceDefaults):
    """`<name>_packed` (int32 words) with `<name>_scale`, the optional `<name>_zero_point`
    and `<name>_shape`, whose values are the [rows, cols] tensor `name`. `groups` scales per
    row (1 per channel), or 0 for one scale of the whole tensor; a zero point's dtype is ""
    where there is none."""

    __slots__ = ()

    decoded = True
    atomic_rows = 1

    @property
    def itemsize(self) -> float:
        """The bytes of the words, scales and zero points over the elements they hold."""
        stored = self.rows * int_packed.words_per_row(self.cols, self.bits) * 4
        if self.groups:
            stored += self.rows * self.groups * itemsize(self.scale_dtype)
            if self.zero_dtype:
                stored += int_packed.zero_rows(0, self.rows, self.bits)[1] * self.groups * 4
        else:
            stored += itemsize(self.scale_dtype)
            stored += itemsize(self.zero_dtype) if self.zero_dtype else 0
        return stored / max(1, self.rows * self.cols)

    @property
    def values_dtype(self) -> str:
        return self.scale_dtype

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
        """A tensor's one scale and zero point (`<name>_shape` is checked once per job, before
        any work: `check_shapes`)."""
        if self.groups:
            return []
        out = [(self.scale_file, self.scale_start, self.scale_start + itemsize(self.scale_dtype))]
        if self.zero_dtype:
            out.append(
                (self.zero_file, self.zero_start, self.zero_start + itemsize(self.zero_dtype))
            )
        return out

    def shape_range(self) -> Range:
        """Where `<name>_shape`'s two integers lie."""
        return (
            self.shape_file,
            self.shape_start,
            self.shape_start + 2 * itemsize(self.shape_dtype),
        )

    def stated_shape(self, raw: Buffer) -> list[int]:
        """What `<name>_shape`'s bytes (`raw`, as `shape_range` lies) say."""
        return [int(v) for v in np.frombuffer(raw, INFO[self.shape_dtype].numpy, 2)]

    def encoded(self, start: int, stop: int, read: Arrays) -> quantized.QuantizedValues:
        """The rows' words, scales and zero points as the kernels read them, decoding each
        value as they load it (`kernels.quantized`): no copy of the values."""
        words, rows, scales, zeros = self._parts(start, stop, read)
        return quantized.int_values(
            words, self.bits, rows, self.cols, scales, zeros, self.scale_dtype
        )  # fmt: skip

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """The rows' values in `values_dtype`, as bytes (`kernels.int_packed.decode`)."""
        words, rows, scales, zeros = self._parts(start, stop, read)
        return int_packed.decode_in(
            words, self.bits, rows, self.cols, scales, zeros, self.scale_dtype,
            floats(rows * self.cols),
        )  # fmt: skip

    def _parts(
        self, start: int, stop: int, read: Arrays
    ) -> tuple[np.ndarray, int, np.ndarray, np.ndarray | None]:
        """The rows' words (bytes), their count, their scales (float32 [rows or 1, G]) and
        zero points (int16, the same shape; None without), from what `ranges` and
        `unit_ranges` read."""
        first, last = start // self.cols, -(-stop // self.cols)
        rows = last - first
        arrays = list(read)
        words = arrays.pop(0)
        scales = int_packed.scale_floats(arrays.pop(0), self.scale_dtype)
        zeros = None
        if self.groups:
            if self.zero_dtype:
                p0, _ = int_packed.zero_rows(first, last, self.bits)
                column = int_packed.unpack_columns(arrays.pop(0), self.bits, self.groups)
                at = first - p0 * 32 // self.bits
                zeros = column[at : at + rows]
        elif self.zero_dtype:
            zeros = arrays.pop(0).view(INFO[self.zero_dtype].numpy)[:1]
        one = self.groups or 1
        z = None if zeros is None else zeros.reshape(-1, one).astype(np.int16)
        return words, rows, scales.reshape(-1, one), z


def check_shapes(weights: Sequence[tuple[PackedIntSource, Checkpoint]], storage: Storage) -> None:
    """Each packed weight's `<name>_shape` (of the input `Checkpoint` beside it) must say the
    shape its words and scales give. Its two integers are values, not a header, so they are
    read here, on the driver once per job before any work (`merge`, `probe`): every one in
    one `Storage.read_ranges`, which a remote store serves as one batch of concurrent range
    requests (8 or 16 bytes each; Kimi-K2-Thinking has 69,120)."""
    if not weights:
        return
    blobs = storage.read_ranges([src.shape_range() for src, _ in weights])
    for (src, ckpt), raw in zip(weights, blobs, strict=True):
        shape = src.stated_shape(raw)
        if shape != [src.rows, src.cols]:
            name = src.name + "_shape"
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.describe(name)} says {shape}, but "
                f"{src.name + '_packed'!r} and its scales hold [{src.rows}, {src.cols}] "
                f"({src.bits}-bit codes): the checkpoint does not agree with itself; save "
                "it again with compressed-tensors, or dequantize it"
            )
