"""What ram-dist knows of each safetensors dtype, in one table (`INFO`), so that the header
parser, the planner, the workers and the kernels agree; torch dtypes are built from it on
first use (importing torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from ram_dist.errors import RamDistError

if TYPE_CHECKING:
    import torch


class DType(NamedTuple):
    """One safetensors dtype's facts, as plain values: the storage layer, `verify` and
    `--help` read them without importing torch (or numpy)."""

    itemsize: int  # bytes per element
    torch: str  # torch's name (a few only newer torch builds have: `SAFETENSORS_DTYPES`)
    numpy: str  # numpy's type of the stored elements (bfloat16 as its bits, FP8 as bytes)
    short: str = ""  # the short name users type (fp32, bf16), for floating dtypes
    exponent: int = 0  # the exponent bits (all ones: NaN or Inf), for the IEEE dtypes merged


#: Every safetensors dtype, by its header name.
INFO: dict[str, DType] = {
    "F64": DType(8, "float64", "float64", "fp64", 0x7FF0000000000000),
    "F32": DType(4, "float32", "float32", "fp32", 0x7F800000),
    "F16": DType(2, "float16", "float16", "fp16", 0x7C00),
    "BF16": DType(2, "bfloat16", "uint16", "bf16", 0x7F80),
    "I64": DType(8, "int64", "int64"),
    "I32": DType(4, "int32", "int32"),
    "I16": DType(2, "int16", "int16"),
    "I8": DType(1, "int8", "int8"),
    "U8": DType(1, "uint8", "uint8"),
    "BOOL": DType(1, "bool", "bool"),
    "U16": DType(2, "uint16", "uint16"),
    "U32": DType(4, "uint32", "uint32"),
    "U64": DType(8, "uint64", "uint64"),
    "F8_E4M3": DType(1, "float8_e4m3fn", "uint8"),
    "F8_E5M2": DType(1, "float8_e5m2", "uint8"),
}

#: Bytes per element of each safetensors dtype string (the header parser's lookup).
ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in INFO.items()}

_TABLES: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """`SAFETENSORS_DTYPES` (str -> torch.dtype) and `TORCH_TO_SAFETENSORS`, built (and torch
    imported) on first use."""
    if name not in ("SAFETENSORS_DTYPES", "TORCH_TO_SAFETENSORS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _TABLES:
        import torch

        table: dict[str, torch.dtype] = {
            k: getattr(torch, v.torch) for k, v in INFO.items() if hasattr(torch, v.torch)
        }
        _TABLES["SAFETENSORS_DTYPES"] = table
        _TABLES["TORCH_TO_SAFETENSORS"] = {v: k for k, v in table.items()}
    return _TABLES[name]


#: The dtypes that take part in a merge (the spec: F64, F32, F16, BF16); others are copied.
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})

#: Names a user may give for a dtype (CLI `--out-dtype`, YAML `dtype` and `out_dtype`), as
#: mergekit's `dtype_from_name` reads them (after `dtype_key`): torch's, short, and "half".
OUT_DTYPE_NAMES: dict[str, str] = {
    **{name: d for d in sorted(FLOATING) for name in (INFO[d].torch, INFO[d].short)},
    "half": "F16",
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    return ITEMSIZE[dtype]


def dtype_key(name: str) -> str:
    """A user's dtype name as `OUT_DTYPE_NAMES` lists it: lower case, no "torch." prefix."""
    return name.strip().lower().removeprefix("torch.")


def dtype_name(dtype: str) -> str:
    """mergekit's (and torch's) name of a floating safetensors dtype: F16 -> float16."""
    return INFO[dtype].torch


def parse_out_dtype(name: str | None) -> str | None:
    """Turn a user's dtype name into a safetensors dtype string (None keeps the base's)."""
    if name is None:
        return None
    key = dtype_key(name)
    if key in OUT_DTYPE_NAMES:
        return OUT_DTYPE_NAMES[key]
    if name.upper() in FLOATING:
        return name.upper()
    valid = ", ".join(sorted(OUT_DTYPE_NAMES))
    raise RamDistError(f"out_dtype {name!r} is not a floating dtype; use one of: {valid}")
