"""A LoRA adapter's weight and bias as `TensorSource`s (`planning.sources`'s protocol): their
values are the base's with the adapter's rank-r product (or bias) added, at the task's
precision (`kernels.lora`, `kernels.precision`), computed by the workers from what they read
(`planning.adapters` makes them). A quantized base's values are decoded by the LoRA kernel
from its stored form as it loads them: no copy of the base's values is made."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ram_dist.dtypes import itemsize
from ram_dist.kernels import lora
from ram_dist.planning.sources import Arrays, Base, Floats, Range, Source, SourceDefaults

#: The least rank whose product is kept for the passes after the first rather than formed in
#: each, in a job that keeps any (`engine.kept_values.MIN_LATER_READS`): below it the
#: product's 2r float32 operations an element cost less than writing a bf16 value to shared
#: memory and reading it back. Set when the product cost about 0.8 ns an element per unit of
#: rank on one core; the kernel's register blocks have since made it about twice as fast,
#: and this bound has not been measured again.
KEEP_MIN_RANK = 8


class _LoraFields(NamedTuple):
    file: str
    """The adapter's weights file."""
    start: int
    """Where `B` starts in it."""
    dtype: str
    """`B`'s dtype."""
    a_start: int
    a_dtype: str
    rank: int
    rows: int
    """The weight's rows and columns, as the base stores it."""
    cols: int
    scale: float
    """`lora_alpha / r` (or `/ sqrt(r)`), already rounded to float32."""
    transposed: bool
    """`delta = (B @ A)^T`: an embedding's, or a `fan_in_fan_out` layer's."""
    theta_dtype: str
    """The dtype of the base values `decode` gets (or of `theta`'s bytes)."""
    values_dtype: str
    """The task's dtype: the base's (bfloat16 for an FP8 base weight)."""
    theta: Source | None = None
    """The adapter's own copy of the base tensor (`base_layer.weight`), which then stands
    for the base's values; None: the base's values."""


class LoraSource(_LoraFields, SourceDefaults):
    """A weight of a task given as a LoRA adapter (`planning.adapters`): its value is the
    base's with the adapter's rank-r product added (`kernels.lora`), rounded to
    `values_dtype`. A unit reads the rows' factors (`coef`: rows of `B`; for a transposed
    product, columns of `A`) per block, and the factor every row shares (`basis`: `A`;
    `B`) once. Its planned bytes per element are the rows' factors', rounded up."""

    __slots__ = ()

    decoded = True

    @property
    def costly(self) -> bool:
        """Whether the product may cost more to form again than its values cost to keep
        and take back (`engine.kept_values`, which keeps them only where several later
        passes read them): from rank `KEEP_MIN_RANK` on."""
        return self.rank >= KEEP_MIN_RANK

    @property
    def itemsize(self) -> int:
        coef = -(-self.rank * itemsize(self.dtype if not self.transposed else self.a_dtype)
                 // self.cols)  # fmt: skip
        return coef + (self.theta.itemsize if self.theta is not None else 0)

    def _rows(self, start: int, stop: int) -> tuple[int, int]:
        return start // self.cols, -(-stop // self.cols)

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The adapter's copy of the base elements (if any), then the rows' factors: rows of
        `B` [rows, r]; for a transposed product, the rows' columns of each row of `A`
        [r, rows]."""
        out = self.theta.ranges(start, stop) if self.theta is not None else []
        first, last = self._rows(start, stop)
        if not self.transposed:
            width = self.rank * itemsize(self.dtype)
            return [*out, (self.file, self.start + first * width, self.start + last * width)]
        size = itemsize(self.a_dtype)
        row = self.rows * size
        at = self.a_start
        return out + [
            (self.file, at + k * row + first * size, at + k * row + last * size)
            for k in range(self.rank)
        ]

    def unit_ranges(self) -> list[Range]:
        """The factor every row shares: `A` [r, cols], or `B` [cols, r] when transposed."""
        if not self.transposed:
            n = self.rank * self.cols * itemsize(self.a_dtype)
            return [(self.file, self.a_start, self.a_start + n)]
        return [(self.file, self.start, self.start + self.rank * self.cols * itemsize(self.dtype))]

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """`cast(float32(theta) + float32(s) * P)`, P in the spec's fixed order, `theta` the
        base at the task's precision: a quantized base's values decoded from its stored form
        as the kernel loads them (`kernels.lora`), never copied first."""
        theta, read = _theta(self.theta, read, base)
        first, last = self._rows(start, stop)
        if not self.transposed:
            coef = lora.as_float32(read[0], self.dtype).reshape(last - first, self.rank)
            basis = lora.as_float32(read[1], self.a_dtype).reshape(self.rank, self.cols)
        else:
            columns = [lora.as_float32(a, self.a_dtype) for a in read[: self.rank]]
            coef = np.ascontiguousarray(np.stack(columns, axis=1))
            basis = lora.as_float32(read[self.rank], self.dtype).reshape(self.cols, self.rank)
            basis = np.ascontiguousarray(basis.T)
        out = floats(stop - start).view(np.uint8)
        scale = np.float32(self.scale)
        return lora.values(theta, self.theta_dtype, coef, basis, scale, start,
                           self.values_dtype, out)  # fmt: skip


class _LoraBiasFields(NamedTuple):
    file: str
    start: int
    dtype: str
    """Where `lora_B.bias` lies in the adapter's weights file, and its dtype."""
    scale: float
    theta_dtype: str
    values_dtype: str
    theta: Source | None = None


class LoraBiasSource(_LoraBiasFields, SourceDefaults):
    """A bias of a task given as a LoRA adapter with `lora_bias`: `cast(float32(bias_B) +
    float32(s) * float32(lora_B.bias))`."""

    __slots__ = ()

    decoded = True

    @property
    def itemsize(self) -> int:
        return super().itemsize + (self.theta.itemsize if self.theta is not None else 0)

    def ranges(self, start: int, stop: int) -> list[Range]:
        out = self.theta.ranges(start, stop) if self.theta is not None else []
        return out + super().ranges(start, stop)

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """The LoRA rule with one row of `stop - start` columns, rank 1 and the factors `1`
        and `lora_B.bias`: `1 * b` is `b` exactly, so the value is the bias rule's."""
        theta, read = _theta(self.theta, read, base)
        bias = lora.as_float32(read[0], self.dtype).reshape(1, stop - start)
        one = np.ones((1, 1), np.float32)
        out = floats(stop - start).view(np.uint8)
        scale = np.float32(self.scale)
        return lora.values(theta, self.theta_dtype, one, np.ascontiguousarray(bias), scale, 0,
                           self.values_dtype, out)  # fmt: skip


def _theta(own: Source | None, read: Arrays, base: Base) -> tuple[lora.Theta, Arrays]:
    """The base values a LoRA source adds to (the adapter's own copy, read first, or the
    base input's: its values, or its stored form), and the rest of what was read."""
    return (read[0], read[1:]) if own is not None else (base, read)
