"""Safetensors dtype strings, their torch dtypes and sizes.

Kept in one table so that the header parser, the planner and the workers agree.
"""

from __future__ import annotations

import torch

from ram_dist.errors import RamDistError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Dtypes that only newer torch builds know.
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}

#: The dtypes that take part in a merge (the spec: F64, F32, F16, BF16); others are copied.
FLOATING = frozenset({"F64", "F32", "F16", "BF16"})

#: Names a user may give for an output dtype (CLI `--out-dtype`, YAML `out_dtype`).
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
    return SAFETENSORS_DTYPES[dtype].itemsize


def parse_out_dtype(name: str | None) -> str | None:
    """Turn a user's dtype name into a safetensors dtype string (None keeps the base's)."""
    if name is None:
        return None
    key = name.strip().lower().removeprefix("torch.")
    if key in OUT_DTYPE_NAMES:
        return OUT_DTYPE_NAMES[key]
    if name.upper() in FLOATING:
        return name.upper()
    valid = ", ".join(sorted(OUT_DTYPE_NAMES))
    raise RamDistError(f"out_dtype {name!r} is not a floating dtype; use one of: {valid}")
