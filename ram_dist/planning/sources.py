"""Where and how one input stores one tensor: the `TensorSource` protocol, and its two
implementations, plain dtypes (`Source`) and fine-grained FP8 blocks (`Fp8Source`).

An input's storage format has this one home. The planner asks a source only for its bytes
per element and its atomic rows; a worker asks it which byte ranges to read for some rows
and how the bytes read become the values the methods merge. Neither asks which format it
is, so a new format (a LoRA adapter next) is a new implementation here and in
`planning.formats`, not new optional fields threaded through the engine.

Sources are named tuples: a DeepSeek-V3 job makes 180,000 of them, and a frozen dataclass
is slow to make and to pickle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from ram_dist.dtypes import itemsize
from ram_dist.kernels import fp8

#: The dtype an FP8 weight's values are merged in: its FP8 inputs are dequantized to it, and
#: its merged values are quantized from it when it is written as FP8 again.
FP8_VALUES_DTYPE = "F32"

#: A byte range of an input file: (url, start, end).
Range = tuple[str, int, int]


class TensorSource(Protocol):
    """One input's stored form of one tensor: what the planner and the workers need of it."""

    @property
    def file(self) -> str:
        """The file that holds the stored elements."""
        ...

    @property
    def start(self) -> int:
        """Where the tensor's stored elements start in `file`."""
        ...

    @property
    def dtype(self) -> str:
        """The safetensors dtype of the stored elements."""
        ...

    @property
    def itemsize(self) -> int:
        """Bytes one element costs to read: what the unit budget and the byte counts plan
        with."""
        ...

    @property
    def values_dtype(self) -> str:
        """The dtype of the values the methods merge: the stored one, unless decoded."""
        ...

    @property
    def decoded(self) -> bool:
        """Whether the values are computed from what is read (`decode`) rather than being
        the stored bytes themselves."""
        ...

    @property
    def atomic_rows(self) -> int | None:
        """Rows that a work unit or a compute block never cuts between, because the values
        of one depend on the others' bytes (an FP8 band); None when any row boundary, or
        any element, may be cut at."""
        ...

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The byte ranges to read for elements [start, stop) (whole atomic rows): the
        stored elements first, then whatever else `decode` needs."""
        ...

    def decode(
        self, start: int, stop: int, read: Sequence[np.ndarray], floats: Callable[[int], np.ndarray]
    ) -> np.ndarray:
        """The values of elements [start, stop), as bytes in `values_dtype`, from the arrays
        `ranges` named, as read; `floats(n)` is a reusable float32 array to write them into."""
        ...


class Source(NamedTuple):
    """A tensor stored in a plain dtype: its bytes are its values."""

    file: str
    start: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def values_dtype(self) -> str:
        return self.dtype

    @property
    def decoded(self) -> bool:
        return False

    @property
    def atomic_rows(self) -> int | None:
        return None

    def ranges(self, start: int, stop: int) -> list[Range]:
        size = itemsize(self.dtype)
        return [(self.file, self.start + start * size, self.start + stop * size)]

    def decode(
        self, start: int, stop: int, read: Sequence[np.ndarray], floats: Callable[[int], np.ndarray]
    ) -> np.ndarray:
        return read[0]


class Fp8Source(NamedTuple):
    """An FP8 weight (`docs/fp8.md`): e4m3 bytes, and one scale per `block` of its
    `cols`-wide rows in its companion. Its values are dequantized to `FP8_VALUES_DTYPE`, a
    band of `block[0]` rows at a time; its planned bytes are its e4m3 bytes (one per
    element), as they always were."""

    file: str
    start: int
    dtype: str
    scale_file: str
    scale_start: int
    scale_dtype: str
    block: tuple[int, int]
    cols: int

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def values_dtype(self) -> str:
        return FP8_VALUES_DTYPE

    @property
    def decoded(self) -> bool:
        return True

    @property
    def atomic_rows(self) -> int | None:
        return self.block[0]

    @property
    def per_band(self) -> int:
        """Scales per band of `block[0]` rows."""
        return -(-self.cols // self.block[1])

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The e4m3 bytes, then the scale rows of the bands they cover."""
        band = self.block[0] * self.cols
        assert start % band == 0, f"{self.file}: an FP8 weight not cut at a band"
        first, last = start // band, -(-stop // band)
        width = itemsize(self.scale_dtype) * self.per_band
        return [
            (self.file, self.start + start, self.start + stop),
            (self.scale_file, self.scale_start + first * width, self.scale_start + last * width),
        ]

    def decode(
        self, start: int, stop: int, read: Sequence[np.ndarray], floats: Callable[[int], np.ndarray]
    ) -> np.ndarray:
        """The spec's one float32 multiplication per element: `float32(q) * scale`."""
        q, scales = read
        values = fp8.dequantize(
            q, fp8.scale_values(scales, self.scale_dtype), self.cols, self.block, floats(q.size)
        )
        return values.view(np.uint8)
