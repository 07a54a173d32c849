"""Safetensors dtype strings, their sizes and (on first use, importing torch) torch dtypes.

Kept in one table so that the header parser, the planner and the workers agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError

if TYPE_CHECKING:
    import torch

#: Bytes per element of each safetensors dtype string. Known without torch, so the storage
#: layer, `verify` and `--help` never import it; the torch dtypes are `SAFETENSORS_DTYPES`.
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip

#: torch's name of each dtype; those only newer torch builds know are left out by those
#: that do not.
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}  # fmt: skip

_TABLES: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """`SAFETENSORS_DTYPES` (str -> torch.dtype) and `TORCH_TO_SAFETENSORS`, built (and torch
    imported) on first use."""
    if name not in ("SAFETENSORS_DTYPES", "TORCH_TO_SAFETENSORS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _TABLES:
        import torch

        table: dict[str, torch.dtype] = {
            k: getattr(torch, v) for k, v in _TORCH_NAMES.items() if hasattr(torch, v)
        }
        _TABLES["SAFETENSORS_DTYPES"] = table
        _TABLES["TORCH_TO_SAFETENSORS"] = {v: k for k, v in table.items()}
    return _TABLES[name]


#: The dtypes that take part in a merge (the spec: F64, F32, F16, BF16); others are copied.
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})

#: Names a user may give for a dtype (CLI `--out-dtype`, YAML `dtype` and `out_dtype`), as
#: mergekit's `dtype_from_name` reads them (after `dtype_key`).
OUT_DTYPE_NAMES: dict[str, str] = {
    "float64": "F64",
    "fp64": "F64",
    "float32": "F32",
    "fp32": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    return ITEMSIZE[dtype]


def dtype_key(name: str) -> str:
    """A user's dtype name as `OUT_DTYPE_NAMES` lists it: lower case, no "torch." prefix."""
    return name.strip().lower().removeprefix("torch.")


def dtype_name(dtype: str) -> str:
    """mergekit's (and torch's) name of a floating safetensors dtype: F16 -> float16."""
    return _TORCH_NAMES[dtype]


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
