"""Where and how one input stores one tensor: the `TensorSource` protocol, and its
implementations: plain dtypes (`Source`), FP8 with a scale per block, row or tensor
(`Fp8Source`) and gpt-oss's MXFP4 blocks and scales (`Mxfp4Source`); compressed-tensors'
packed INT4/INT8 are in `planning.packed_sources`, a LoRA adapter's weight and bias in
`planning.lora_sources`.

An input's storage format has this one home. The planner asks a source only for its bytes
per element and its atomic rows; a worker asks it which byte ranges to read for some rows
and how the bytes read become the values the methods merge. Neither asks which format it
is, so a new format is a new implementation here (and where its checkpoints are
recognised: `planning.formats`, `planning.adapters`), not new optional fields threaded
through the engine.

A task's tensor may be the base's own (`BaseValues`: one an adapter leaves alone): the
workers then read nothing more for it and take the base's values. A source whose values are
computed from the base's (`LoraSource`) gets them in `decode`: a quantized base's as its
stored form, which it decodes as it loads it.

Every source derives from `SourceDefaults`, the protocol's defaults (a plain tensor's), and
says only what differs. Its fields are a NamedTuple it derives from first, so a source is a
tuple: a DeepSeek-V3 job makes 180,000 of them, and a frozen slotted dataclass takes 1.5x as
long to make and 3.6x as long to unpickle (3 fields, Python 3.11).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from ram_dist.dtypes import itemsize
from ram_dist.kernels import fp8, int_packed, mxfp4, quantized

#: The dtype an FP8 weight's values are merged in: its FP8 inputs are dequantized to it, and
#: its merged values are quantized from it when it is written as FP8 again.
FP8_VALUES_DTYPE = "F32"

#: The dtype an MXFP4 weight's values are merged in: each is exact in it.
MXFP4_VALUES_DTYPE = "BF16"

#: Bytes an MXFP4 value costs to read: its 4-bit code, and its group's scale byte shared by 32.
MXFP4_ITEMSIZE = (mxfp4.GROUP // 2 + 1) / mxfp4.GROUP

#: A byte range of an input file: (url, start, end).
Range = tuple[str, int, int]

#: What `decode` and `encoded` get: the arrays the ranges named, as read.
Arrays = Sequence[np.ndarray]

#: `decode`'s `floats(n)`: a reusable float32 array of n elements to write the values into.
Floats = Callable[[int], np.ndarray]

#: `decode`'s `base`: the base input's values of the same elements, as bytes, or, where the
#: base has a stored form the kernels read (`encoded`: a quantized base), that form, which
#: a source computing from the base's values (`LoraSource`) decodes as it loads it.
Base = np.ndarray | fp8.Fp8Values | quantized.QuantizedValues


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
    def itemsize(self) -> float:
        """Bytes one element costs to read, on average over the tensor: what the unit
        budget and the byte counts plan with. A fraction for a packed format (MXFP4:
        17/32, a half byte of code and a scale byte per 32 values), whose stored tensors
        it counts all together."""
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

    def unit_ranges(self) -> list[Range]:
        """Byte ranges `decode` needs whatever the elements (a LoRA factor all rows share):
        read once per unit and tensor, not per compute block."""
        ...

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """The values of elements [start, stop), as bytes in `values_dtype`, from the arrays
        `ranges` and then `unit_ranges` named, as read; `floats(n)` is a reusable float32
        array to write them into; `base` the base input's values of the same elements, or
        its stored form where it has one (`Base`)."""
        ...

    def encoded(self, start: int, stop: int, read: Arrays) -> object | None:
        """The stored form of elements [start, stop) (as `ranges` read them) that the fused
        kernels read in place of the decoded values (an FP8 input's `kernels.fp8.Fp8Values`,
        an MXFP4 or packed INT input's `kernels.quantized.QuantizedValues`), or None."""
        ...


class SourceDefaults:
    """The protocol's defaults, which are a plain tensor's: its stored bytes are its values,
    read by `ranges` alone and cut anywhere. Every source derives from it after the NamedTuple
    of its fields (`class Fp8Source(_Fp8Fields, SourceDefaults)`, so that a field of a
    member's name, as `BaseValues.values_dtype`, wins) and says only what differs, so that no
    format repeats them. No slots of its own: a source stays a tuple."""

    __slots__ = ()

    file: str
    start: int
    dtype: str
    decoded: bool = False
    atomic_rows: int | None = None
    costly: bool = False
    """Whether `decode` forms values that may cost more to form again than to keep (a LoRA
    product): the engine keeps them for the passes after the first, where several read them
    (`engine.kept_values`)."""

    @property
    def itemsize(self) -> float:
        return itemsize(self.dtype)

    @property
    def values_dtype(self) -> str:
        return self.dtype

    def ranges(self, start: int, stop: int) -> list[Range]:
        size = itemsize(self.dtype)
        return [(self.file, self.start + start * size, self.start + stop * size)]

    def unit_ranges(self) -> list[Range]:
        return []

    def encoded(self, start: int, stop: int, read: Arrays) -> object | None:
        return None

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        return read[0]


def same_as_base(sources: Sequence[TensorSource]) -> list[bool]:
    """Per input (base first), whether its tensor is the base's own (`BaseValues`)."""
    return [isinstance(src, BaseValues) for src in sources]


class _BaseValuesFields(NamedTuple):
    values_dtype: str
    """The base's values' dtype."""
    file: str = ""
    start: int = 0


class BaseValues(_BaseValuesFields, SourceDefaults):
    """A task's tensor that is the base's own (one an adapter leaves alone): it reads
    nothing, and its values are the base's, which the workers read once, for the base."""

    __slots__ = ()

    itemsize = 0

    @property
    def dtype(self) -> str:
        return self.values_dtype

    def ranges(self, start: int, stop: int) -> list[Range]:
        return []

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        return base


class _SourceFields(NamedTuple):
    file: str
    start: int
    dtype: str


class Source(_SourceFields, SourceDefaults):
    """A tensor stored in a plain dtype: its bytes are its values (the defaults, all of
    them)."""

    __slots__ = ()


class _Fp8Fields(NamedTuple):
    file: str
    start: int
    dtype: str
    scale_file: str
    scale_start: int
    scale_dtype: str
    block: tuple[int, int]
    cols: int
    rounded_to: str = ""
    """The dtype each value is rounded to after its multiplication (compressed-tensors'
    FP8, decoded in its scale's dtype: bfloat16 for a bfloat16 scale); "" for none (block
    FP8, fbgemm_fp8: float32)."""


class Fp8Source(_Fp8Fields, SourceDefaults):
    """An FP8 weight (`docs/fp8.md`, `docs/quantized.md`): e4m3 bytes, and one scale per
    `block` of its `cols`-wide rows in its companion (fine-grained FP8's blocks; a row,
    `(1, cols)`, or the whole tensor, `(rows, cols)`, for compressed-tensors' and fbgemm's
    per-channel and per-tensor scales). Its values are dequantized to `FP8_VALUES_DTYPE`, a
    band of `block[0]` rows at a time; its planned bytes are its e4m3 bytes (one per
    element), as they always were."""

    __slots__ = ()

    decoded = True

    @property
    def values_dtype(self) -> str:
        return self.rounded_to or FP8_VALUES_DTYPE

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

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """The spec's one float32 multiplication per element: `float32(q) * scale`, then
        rounded to `rounded_to` where it is set."""
        values = self._stored(read).values(floats(read[0].size))
        return (
            int_packed.in_dtype(values, self.rounded_to)
            if self.rounded_to
            else values.view(np.uint8)
        )

    def encoded(
        self, start: int, stop: int, read: Arrays
    ) -> fp8.Fp8Values | quantized.QuantizedValues | None:
        """The e4m3 bytes and the float32 scales of their bands, as the kernels read them:
        where each value is rounded after its multiplication (a scale per row or per tensor),
        as `kernels.quantized`'s FP8 form, which the kernels decode and round as they load."""
        if not self.rounded_to:
            return self._stored(read)
        if self.block[1] != self.cols:
            return None  # compressed-tensors' FP8 has no column blocks: not a form the kernels take
        scales = fp8.scale_values(read[1], self.scale_dtype)
        rows = (stop - start) // self.cols
        return quantized.fp8_values(read[0], scales, rows, self.cols, self.rounded_to)

    def _stored(self, read: Arrays) -> fp8.Fp8Values:
        q, scales = read[0], read[1]
        return fp8.Fp8Values(q, fp8.scale_values(scales, self.scale_dtype), self.cols, self.block)


class Fp8ExpertSource(Fp8Source):
    """A 3-D FP8 weight [experts, rows, cols] with a float32 scale per expert and column
    (`fbgemm_fp8`'s Llama-4 experts: `gate_up_proj` with `gate_up_proj_scale` [E, 1, C],
    `down_proj` with `down_proj_scale` [E, C, 1], both [E, C] as stored). Its fields are an
    FP8 weight's over the rows of all experts, `cols` wide, with `block` (rows, 1): a
    scale's group is a column of one expert, so every band is one expert. An expert is one
    row of the tensor (its first axis), which units never cut (`atomic_rows`)."""

    __slots__ = ()

    atomic_rows = 1


class _Mxfp4Fields(NamedTuple):
    file: str
    start: int
    """Where `<name>_blocks` lies."""
    dtype: str
    scale_file: str
    scale_start: int
    rows: int
    groups: int


class Mxfp4Source(_Mxfp4Fields, SourceDefaults):
    """An MXFP4 weight as gpt-oss ships it (`kernels.mxfp4`): `<name>_blocks` (uint8,
    [experts, rows, groups, 16]) and `<name>_scales` (uint8, [experts, rows, groups]), whose
    values are the tensor [experts, groups * 32, rows]. Every value is exact in bfloat16, so
    they are decoded into bfloat16 (`values_dtype`): the same values as float32, in half the
    bytes, and a base that holds no bits finer than bfloat16 (`kernels.precision`). One
    expert's values need every byte of its blocks (they are its unpacked codes transposed),
    so an expert, one row of the values, is never cut (`atomic_rows`). The fused kernels
    read the blocks and scales as stored (`encoded`, `MergeMethod.reads_stored`), decoding
    each value as they load it. Its planned bytes are what is read: the blocks' half byte
    and the scales' 1/32 per element (`itemsize` 17/32)."""

    __slots__ = ()

    itemsize = MXFP4_ITEMSIZE
    values_dtype = MXFP4_VALUES_DTYPE
    decoded = True
    atomic_rows = 1

    @property
    def per_expert(self) -> int:
        """Values of one expert."""
        return self.groups * mxfp4.GROUP * self.rows

    def ranges(self, start: int, stop: int) -> list[Range]:
        """The experts' blocks, then their scales."""
        assert start % self.per_expert == 0, f"{self.file}: an MXFP4 weight not cut at an expert"
        first, last = start // self.per_expert, -(-stop // self.per_expert)
        codes = self.rows * self.groups * mxfp4.GROUP // 2
        scales = self.rows * self.groups
        return [
            (self.file, self.start + first * codes, self.start + last * codes),
            (self.scale_file, self.scale_start + first * scales, self.scale_start + last * scales),
        ]

    def encoded(self, start: int, stop: int, read: Arrays) -> quantized.QuantizedValues:
        """The experts' blocks and scales as the kernels read them, decoding each value as
        they load it (`kernels.quantized`): no copy of the values."""
        return quantized.mxfp4_values(read[0], read[1], self.rows, self.groups)

    def decode(self, start: int, stop: int, read: Arrays, floats: Floats, base: Base) -> np.ndarray:
        """The experts' values as bfloat16 (`kernels.mxfp4.decode_bf16`), as bytes."""
        out = floats(stop - start).view(np.uint16)
        return mxfp4.decode_bf16(read[0], read[1], self.rows, self.groups, out).view(np.uint8)
