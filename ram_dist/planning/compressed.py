"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor and
Kimi-K2-Thinking ship them) and `fbgemm_fp8` ones (Llama-4's FP8 release): which stored
tensors are one weight, what it decodes to, and the refusals of everything else.

Read on the driver from `config.json`'s `quantization_config` and the headers, before any
tensor byte is read (`docs/quantized.md`). Merged:

- `pack-quantized` INT4/INT8 (`type: int`, `num_bits` 4 or 8, `strategy` group, channel or
  tensor, symmetric or with a zero point): `N.weight_packed`, `N.weight_scale`, optional
  `N.weight_zero_point`, `N.weight_shape` are the weight `N.weight` (`kernels.int_packed`);
- `float-quantized` FP8 (e4m3, `strategy` channel or tensor): `N.weight` and
  `N.weight_scale`, an FP8 weight whose scales cover a row or the whole tensor, decoded in
  the scale's dtype;
- `fbgemm_fp8`: `N.weight` and `N.weight_scale` (F32, one per row): the same, in float32;
  and Llama-4's 3-D experts `N` [E, R, C] with `N_scale` (F32, one per expert and column).

The scheme of each weight is read from its tensors (the scales' shape gives the strategy,
the words' the width), checked against the config's groups: which group targets which
module is a matter of module classes the headers do not hold.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo
from ram_dist.kernels import int_packed

COMPRESSED = "compressed-tensors"
FBGEMM = "fbgemm_fp8"
PACKED, FLOAT = "pack-quantized", "float-quantized"
#: The suffixes of a compressed weight's stored tensors, after `N.`.
WEIGHT, PACKED_SUFFIX, SCALE, ZERO, SHAPE = (
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
)
#: The dtype a packed INT weight is written in: a 4-bit grid cannot hold an RL update.
INT_OUT_DTYPE = "BF16"
FP8_SCALE_DTYPES = ("F32", "BF16")
STRATEGIES = {PACKED: ("group", "channel", "tensor"), FLOAT: ("channel", "tensor")}
#: A config group's weights: (num_bits, strategy, group_size; 0 but for groups).
Scheme = tuple[int, str, int]
DEQUANTIZE = (
    "dequantize it first (e.g. load it with transformers and `save_pretrained` it in bfloat16)"
)


@dataclass(frozen=True)
class PackedWeight:
    """A `pack-quantized` weight's stored tensors and its decoded [rows, cols]."""

    packed: TensorInfo
    scale: TensorInfo
    zero: TensorInfo | None
    shape: TensorInfo
    bits: int
    rows: int
    cols: int
    groups: int
    """Scales per row, or 0 for one scale of the whole tensor."""


@dataclass(frozen=True)
class ScaledFp8:
    """An FP8 weight with a scale per row or one for the tensor (`block`), decoded in the
    scale's dtype where `rounded` (compressed-tensors), in float32 otherwise (fbgemm)."""

    scale: TensorInfo
    block: tuple[int, int]
    rounded: bool


@dataclass(frozen=True)
class Compressed:
    """A checkpoint's compressed weights, by the name the merge knows them by (`N.weight`)."""

    method: str
    packed: dict[str, PackedWeight]
    fp8: dict[str, ScaledFp8]

    @property
    def companions(self) -> set[str]:
        names: set[str] = set()
        for name, w in self.packed.items():
            stem = name[: -len(WEIGHT)]
            names |= {stem + PACKED_SUFFIX, stem + SCALE, stem + SHAPE}
            if w.zero is not None:
                names.add(stem + ZERO)
        return names | {f.scale.name for f in self.fp8.values()}

    def describe(self, plain: str) -> str:
        parts = []
        if self.packed:
            bits = "/".join(f"INT{b}" for b in sorted({w.bits for w in self.packed.values()}))
            parts.append(f"{bits} pack-quantized, {len(self.packed)} weights")
        if self.fp8:
            parts.append(f"FP8 per channel or tensor, {len(self.fp8)} weights")
        return f"{self.method} ({'; '.join(parts)}; the rest {plain})"


def scale_name(name: str) -> str:
    """An FP8 weight's scale tensor (`N.weight` -> `N.weight_scale`)."""
    return name + "_scale"


def recognize_compressed(ckpt: Checkpoint, quant: Mapping[str, Any]) -> Compressed:
    """The compressed weights of a `compressed-tensors` or `fbgemm_fp8` checkpoint, each
    checked against the config and against its companions; a `CheckpointError` naming the
    tensor and its file for anything else."""
    method = quant.get("quant_method")
    if method == FBGEMM:
        widths: dict[str, frozenset[Scheme]] = {FLOAT: frozenset({(8, "channel", 0)})}
    else:
        widths = _schemes(ckpt, quant)
    packed: dict[str, PackedWeight] = {}
    fp8: dict[str, ScaledFp8] = {}
    for name, info in sorted(ckpt.tensors.items()):
        if name.endswith("." + PACKED_SUFFIX):
            if PACKED not in widths:
                _refuse_tensor(ckpt, name, f"packed, but config.json declares no {PACKED} group")
            weight = name[: -len(PACKED_SUFFIX)] + WEIGHT
            packed[weight] = _packed(ckpt, weight, info, widths[PACKED])
        elif info.dtype.startswith("F8_"):
            if FLOAT not in widths:
                _refuse_tensor(
                    ckpt, name, f"{info.dtype}, but config.json declares no {FLOAT} group"
                )
            fp8[name] = _scaled_fp8(ckpt, info, widths[FLOAT], rounded=method != FBGEMM)
        elif name.endswith(("_g_idx", ".input_scale", ".k_scale", ".v_scale")):
            _refuse_tensor(
                ckpt,
                name,
                "a quantization parameter ram-dist does not merge "
                "(activation order, or static activation scales)",
            )
    if not packed and not fp8:
        raise CheckpointError(
            f"{ckpt.label} ({ckpt.url}): config.json declares quant_method {method!r} but no "
            "tensor is quantized; fix the config or the checkpoint"
        )
    return Compressed(method, packed, fp8)


def _schemes(ckpt: Checkpoint, quant: Mapping[str, Any]) -> dict[str, frozenset[Scheme]]:
    """Per format, the schemes of the config's groups; anything the spec does not define
    refused."""
    where = f"{ckpt.label} ({ckpt.url}): config.json quantization_config"
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(
            f"{where} has quantization_status {status!r}: only compressed "
            f"checkpoints are merged; {DEQUANTIZE}"
        )
    sparsity = quant.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise CheckpointError(
            f"{where} has a sparsity_config ({sparsity.get('format')}): "
            f"sparse weights are not merged; {DEQUANTIZE}"
        )
    if quant.get("kv_cache_scheme"):
        raise CheckpointError(
            f"{where} has a kv_cache_scheme (k_scale/v_scale tensors), "
            f"which is not merged; {DEQUANTIZE}"
        )
    out: dict[str, set[Scheme]] = {}
    for group, scheme in sorted((quant.get("config_groups") or {}).items()):
        fmt = scheme.get("format") or quant.get("format")
        weights = scheme.get("weights") or {}
        what = f"{where}, group {group!r}"
        if fmt not in STRATEGIES:
            raise CheckpointError(
                f"{what} has format {fmt!r}: ram-dist merges compressed-tensors' "
                f"{PACKED} (INT4/INT8) and {FLOAT} (FP8) only; {DEQUANTIZE}"
            )
        kind = "int" if fmt == PACKED else "float"
        bits, strategy = weights.get("num_bits"), weights.get("strategy")
        ok_bits = int_packed.BITS if fmt == PACKED else (8,)
        if (
            weights.get("type", kind) != kind
            or bits not in ok_bits
            or strategy not in STRATEGIES[fmt]
        ):
            raise CheckpointError(
                f"{what} quantizes weights as {weights.get('type')} {bits}-bit, strategy "
                f"{strategy!r}: {fmt} is merged as {kind} {'/'.join(map(str, ok_bits))}-bit "
                f"with strategy {' or '.join(STRATEGIES[fmt])}; {DEQUANTIZE}"
            )
        if weights.get("actorder") not in (None, False):
            raise CheckpointError(
                f"{what} has actorder {weights.get('actorder')!r} (g_idx "
                f"tensors), which is not merged; {DEQUANTIZE}"
            )
        acts = scheme.get("input_activations")
        if acts and not acts.get("dynamic", False):
            raise CheckpointError(
                f"{what} has static input activation scales (input_scale "
                f"tensors), which are not merged; {DEQUANTIZE}"
            )
        size = weights.get("group_size") if strategy == "group" else 0
        if strategy == "group" and not (isinstance(size, int) and size > 0):
            raise CheckpointError(
                f"{what} has strategy 'group' with group_size {size!r}; fix the config"
            )
        out.setdefault(fmt, set()).add((bits, strategy, size))
    if not out:
        raise CheckpointError(
            f"{where} has no config_groups, so no weight's scheme is known; " + DEQUANTIZE
        )
    return {fmt: frozenset(found) for fmt, found in out.items()}


def _refuse_tensor(ckpt: Checkpoint, name: str, why: str) -> None:
    raise CheckpointError(f"tensor {name!r} in {ckpt.describe(name)} is {why}; {DEQUANTIZE}")


def _packed(
    ckpt: Checkpoint, weight: str, words: TensorInfo, schemes: frozenset[Scheme]
) -> PackedWeight:
    """A packed weight's tensors, its width and its decoded shape, checked."""
    stem = weight[: -len(WEIGHT)]
    tensors = ckpt.tensors
    scale, zero, shape = (tensors.get(stem + s) for s in (SCALE, ZERO, SHAPE))

    def where() -> str:  # composed only for a message: a Kimi-K2 base has 69,120 weights
        return f"tensor {words.name!r} in {ckpt.describe(words.name)}"

    if words.dtype != "I32" or len(words.shape) != 2:
        raise CheckpointError(
            f"{where()} is {words.dtype} {list(words.shape)}: packed weights "
            f"are I32 matrices; {DEQUANTIZE}"
        )
    for part, info in ((SCALE, scale), (SHAPE, shape)):
        if info is None:
            raise CheckpointError(
                f"{where()} has no {stem + part!r}, so its values are unknown; {DEQUANTIZE}"
            )
    assert scale is not None and shape is not None
    rows, per_row = words.shape
    numel = 1
    for n in scale.shape:
        numel *= n
    groups = 0 if numel == 1 and rows != 1 else (scale.shape[-1] if len(scale.shape) == 2 else -1)
    if (
        scale.dtype not in int_packed.SCALE_DTYPES
        or groups < 0
        or (groups and scale.shape[0] != rows)
    ):
        raise CheckpointError(
            f"tensor {scale.name!r} in {ckpt.describe(scale.name)} is {scale.dtype} "
            f"{list(scale.shape)}; the scales of {words.name!r} ({rows} rows) must be BF16, "
            f"F16 or F32, one per row and group ([{rows}, groups]) or one for the tensor"
        )
    if shape.dtype not in ("I64", "I32") or shape.shape != (2,):
        raise CheckpointError(
            f"tensor {shape.name!r} in {ckpt.describe(shape.name)} is "
            f"{shape.dtype} {list(shape.shape)}, not a shape ([2] integers)"
        )
    strategy = "tensor" if not groups else ("channel" if groups == 1 else "group")
    widths = _widths(schemes, strategy, groups, per_row)
    if len(widths) != 1:
        declared = ", ".join(
            f"{b}-bit {s}" + (f" of {g}" if g else "") for b, s, g in sorted(schemes)
        )
        why = "which no group of" if not widths else "which more than one group of"
        raise CheckpointError(
            f"{where()} is [{rows}, {per_row}] words with scales {list(scale.shape)} "
            f"({strategy} strategy), {why} config.json ({declared}) fits; fix the config "
            f"or the checkpoint, or {DEQUANTIZE}"
        )
    bits, cols = widths[0]  # type: ignore[misc]
    if zero is not None:
        p0, p1 = int_packed.zero_rows(0, rows, bits)
        want = (p1, groups) if groups else None
        ints = ("I32",) if groups else ("I8", "I16", "I32", "I64")
        if zero.dtype not in ints or (want is not None and zero.shape != want):
            raise CheckpointError(
                f"tensor {zero.name!r} in {ckpt.describe(zero.name)} is {zero.dtype} "
                f"{list(zero.shape)}; the zero points of {words.name!r} must be "
                + (
                    f"I32 words [{p1}, {groups}] (packed along dimension 0)"
                    if groups
                    else "one integer"
                )
            )
    return PackedWeight(words, scale, zero, shape, bits, rows, cols, groups)


@functools.lru_cache(maxsize=256)
def _widths(
    schemes: frozenset[Scheme], strategy: str, groups: int, per_row: int
) -> list[tuple[int, int]]:
    """Every (bits, columns) the schemes give such a weight (`_width`), cached: the
    weights of a checkpoint come in a few shapes."""
    return sorted({_width(scheme, strategy, groups, per_row) for scheme in schemes} - {None})  # type: ignore[arg-type]


def _width(scheme: Scheme, strategy: str, groups: int, per_row: int) -> tuple[int, int] | None:
    """(bits, columns) of a weight of `per_row` words and `groups` scales per row under
    `scheme`, or None where it does not fit. A group's size fixes the columns; a channel or
    tensor scale leaves them to the words (the most they hold: every published width is a
    multiple of 32 / bits, and `N.weight_shape` is checked before any work:
    `packed_sources.check_shapes`)."""
    bits, declared, size = scheme
    if strategy == "group" or (strategy == "channel" and declared == "group"):
        if declared != "group":
            return None
        cols = groups * size
        return (bits, cols) if int_packed.words_per_row(cols, bits) == per_row else None
    return (bits, per_row * 32 // bits) if declared == strategy else None


def _scaled_fp8(
    ckpt: Checkpoint, info: TensorInfo, schemes: frozenset[Scheme], rounded: bool
) -> ScaledFp8:
    """An FP8 weight's scale, checked: one per row, or one for the tensor."""
    name = info.name
    where = f"tensor {name!r} in {ckpt.describe(name)}"
    if not rounded and info.dtype == "F8_E4M3" and len(info.shape) == 3:
        return _fbgemm_experts(ckpt, info)
    if info.dtype != "F8_E4M3" or len(info.shape) != 2:
        raise CheckpointError(
            f"{where} is {info.dtype} {list(info.shape)}: FP8 weights are "
            f"F8_E4M3 matrices here; {DEQUANTIZE}"
        )
    scale = ckpt.tensors.get(scale_name(name))
    if scale is None:
        raise CheckpointError(
            f"{where} has no {scale_name(name)!r}, so its values are unknown; {DEQUANTIZE}"
        )
    rows, cols = info.shape
    numel = 1
    for n in scale.shape:
        numel *= n
    per_row = scale.shape in ((rows, 1),) and rows != 1
    per_tensor = numel == 1
    strategy = "channel" if per_row or (per_tensor and rows == 1) else "tensor"
    if (
        scale.dtype not in FP8_SCALE_DTYPES
        or not (per_row or per_tensor)
        or (8, strategy, 0) not in schemes
    ):
        raise CheckpointError(
            f"tensor {scale.name!r} in {ckpt.describe(scale.name)} is {scale.dtype} "
            f"{list(scale.shape)}; the scales of {name!r} ({list(info.shape)}) must be F32 or "
            f"BF16, [{rows}, 1] or one value, as config.json's scheme says; {DEQUANTIZE}"
        )
    block = (1, cols) if strategy == "channel" else (rows, cols)
    return ScaledFp8(scale, block, rounded and scale.dtype != "F32")


def _fbgemm_experts(ckpt: Checkpoint, info: TensorInfo) -> ScaledFp8:
    """A Llama-4 expert weight of `fbgemm_fp8` ([E, R, C] e4m3), checked: its scale is F32,
    one per expert and column ([E, 1, C] for `gate_up_proj`, [E, C, 1] for `down_proj`, as
    transformers' `FbgemmFp8Llama4TextExperts` holds them: each is a row's scale of the
    expert's [C, R] matrix that its GEMM reads)."""
    name = info.name
    scale = ckpt.tensors.get(scale_name(name))
    if scale is None:
        raise CheckpointError(
            f"tensor {name!r} in {ckpt.describe(name)} has no {scale_name(name)!r}, so its "
            f"values are unknown; {DEQUANTIZE}"
        )
    experts, rows, cols = info.shape
    if scale.dtype != "F32" or scale.shape not in ((experts, 1, cols), (experts, cols, 1)):
        raise CheckpointError(
            f"tensor {scale.name!r} in {ckpt.describe(scale.name)} is {scale.dtype} "
            f"{list(scale.shape)}; the scales of the expert weight {name!r} "
            f"({list(info.shape)}) must be F32, one per expert and column: "
            f"[{experts}, 1, {cols}] or [{experts}, {cols}, 1]; {DEQUANTIZE}"
        )
    return ScaledFp8(scale, (rows, 1), False)
