"""What each input stores its weights as: floating point, fine-grained FP8 blocks,
gpt-oss's MXFP4 blocks and scales, or compressed-tensors' and fbgemm_fp8's weights
(`planning.compressed`).

Recognised per checkpoint, from its `config.json`'s `quantization_config` and its headers,
on the driver before any tensor byte is read (`docs/exactness.md`, `docs/fp8.md` and
`docs/quantized.md` give the rules). An FP8 weight `W` (F8_E4M3, [R, C]) and its companion
`W_scale_inv` (F32 or BF16, [ceil(R/bm), ceil(C/bn)]) are one tensor to the merge: its
values are the dequantized ones, and the companion never takes part on its own. An MXFP4
weight `N` is stored as the pair `N_blocks` and `N_scales` and is, to the merge, the tensor
`N` of their decoded shape (`kernels.mxfp4`): the name and layout of a bf16 checkpoint of
the same model, and of its agents; a compressed-tensors packed weight is, likewise, the
tensor `N.weight` of its `weight_shape`. Every other quantized or packed format is refused here,
naming the checkpoint, the file, the tensor and the format: merging its packed integers as
numbers, or copying the base's, would drop the agents' updates without a word.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ram_dist.dtypes import FLOATING, dtype_name
from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo
from ram_dist.kernels import mxfp4
from ram_dist.planning import compressed as ct
from ram_dist.planning.compressed import Compressed, recognize_compressed
from ram_dist.planning.packed_sources import PackedIntSource
from ram_dist.planning.sources import (
    Fp8ExpertSource,
    Fp8Source,
    Mxfp4Source,
    Source,
    TensorSource,
)

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
#: An MXFP4 weight's two stored tensors, by the suffix of its name, and their dtype.
BLOCKS_SUFFIX, SCALES_SUFFIX, MXFP4_DTYPE = "_blocks", "_scales", "U8"
#: The dtype an MXFP4 weight is written in, and is to a job before that: a 4-bit grid
#: cannot hold an RL update, so requantizing would erase the merge.
MXFP4_OUT_DTYPE = "BF16"
SCALE_DTYPES = ("F32", "BF16")
#: Tensor-name endings of packed formats, and the format they belong to.
PACKED_SUFFIXES = {
    ".qweight": "GPTQ/AWQ packed int4",
    ".qzeros": "GPTQ/AWQ packed int4",
    ".g_idx": "GPTQ packed int4",
    ".scales": "GPTQ/AWQ packed int4",
    "_blocks": "MXFP4 (blocks and scales)",
    ".weight_packed": "compressed-tensors packed",
    ".weight_scale": "compressed-tensors or fbgemm_fp8",
    ".SCB": "bitsandbytes int8",
    ".absmax": "bitsandbytes 4-bit",
    ".quant_map": "bitsandbytes 4-bit",
    ".quant_state.bitsandbytes__nf4": "bitsandbytes 4-bit",
    ".quant_state.bitsandbytes__fp4": "bitsandbytes 4-bit",
}
DEQUANTIZE = (
    "dequantize it first (e.g. load it with transformers and `save_pretrained` it in bfloat16)"
)


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's fine-grained FP8 layout: the block size and each FP8 weight's scales."""

    block: tuple[int, int]
    scales: dict[str, TensorInfo]
    """Per FP8 weight name, its companion `<name>_scale_inv`."""


@dataclass(frozen=True)
class Mxfp4Pair:
    """An MXFP4 weight's stored tensors."""

    blocks: TensorInfo
    scales: TensorInfo


@dataclass(frozen=True)
class Format:
    """How one checkpoint stores its weights. The rest of the package asks it only for the
    tensors the merge sees (`view`: an MXFP4 weight by its decoded name and shape), each
    one's source (`source`), the stored tensors that are part of another's (`companions`),
    whether any values are decoded (`decodes`), an FP8 weight's scale tensor (`scale_name`)
    and its words (`describe`): `fp8`, `mxfp4` and `compressed` are read here alone."""

    fp8: Fp8Blocks | None
    mxfp4: dict[str, Mxfp4Pair] = field(default_factory=dict)
    """Per MXFP4 weight (its decoded name), its blocks and scales."""
    compressed: Compressed | None = None
    """compressed-tensors' packed INT and FP8 weights, or fbgemm_fp8's (`planning.compressed`)."""

    @functools.cached_property
    def companions(self) -> frozenset[str]:
        """Names of the stored tensors that are part of a weight, not tensors: FP8 scales,
        and MXFP4 blocks and scales (the weight goes by its decoded name)."""
        names = {n + SCALE_SUFFIX for n in self.fp8.scales} if self.fp8 is not None else set()
        for name in self.mxfp4:
            names |= {name + BLOCKS_SUFFIX, name + SCALES_SUFFIX}
        if self.compressed is not None:
            names |= self.compressed.companions
        return frozenset(names)

    @property
    def decodes(self) -> bool:
        """Whether some tensor's values are decoded from what the checkpoint stores."""
        return self.fp8 is not None or bool(self.mxfp4) or self.compressed is not None

    def view(self, ckpt: Checkpoint) -> dict[str, TensorInfo]:
        """The checkpoint's tensors as the merge sees them: its stored ones but the
        companions, and each MXFP4 weight by its decoded name and shape, at its blocks'
        place and in `MXFP4_OUT_DTYPE` (what it is written in)."""
        if not self.companions:
            return ckpt.tensors
        out = {n: i for n, i in ckpt.tensors.items() if n not in self.companions}
        for name, pair in self.mxfp4.items():
            b = pair.blocks
            shape = mxfp4.decoded_shape(b.shape)
            out[name] = TensorInfo(name, MXFP4_OUT_DTYPE, shape, b.file, b.start, b.end)
        for name, w in self.compressed.packed.items() if self.compressed is not None else ():
            p = w.packed
            out[name] = TensorInfo(name, ct.INT_OUT_DTYPE, (w.rows, w.cols), p.file, p.start, p.end)
        return out

    def source(self, info: TensorInfo) -> TensorSource:
        """Where and how this checkpoint stores tensor `info` (of `view`; `planning.sources`):
        the one place that says which implementation a tensor's format is."""
        pair = self.mxfp4.get(info.name)
        if pair is not None:
            e, r, g, _ = pair.blocks.shape
            return Mxfp4Source(
                pair.blocks.file, pair.blocks.start, pair.blocks.dtype, pair.scales.file,
                pair.scales.start, r, g,
            )  # fmt: skip
        if self.compressed is not None:
            return self._compressed_source(info, self.compressed)
        if self.fp8 is None or info.name not in self.fp8.scales:
            return Source(info.file, info.start, info.dtype)
        scale = self.fp8.scales[info.name]
        return Fp8Source(
            info.file, info.start, info.dtype, scale.file, scale.start, scale.dtype,
            self.fp8.block, info.shape[1],
        )  # fmt: skip

    def _compressed_source(self, info: TensorInfo, found: Compressed) -> TensorSource:
        w = found.packed.get(info.name)
        if w is not None:
            zero = w.zero
            return PackedIntSource(
                w.packed.file, w.packed.start, w.packed.dtype, info.name,
                w.scale.file, w.scale.start, w.scale.dtype,
                zero.file if zero else "", zero.start if zero else 0, zero.dtype if zero else "",
                w.shape.file, w.shape.start, w.shape.dtype, w.bits, w.rows, w.cols, w.groups,
            )  # fmt: skip
        f = found.fp8.get(info.name)
        if f is None:
            return Source(info.file, info.start, info.dtype)
        kind = Fp8ExpertSource if len(info.shape) == 3 else Fp8Source  # fbgemm's experts
        return kind(
            info.file, info.start, info.dtype, f.scale.file, f.scale.start, f.scale.dtype,
            f.block, info.shape[-1], f.scale.dtype if f.rounded else "",
        )  # fmt: skip

    def scale_name(self, name: str) -> str:
        """The stored scale tensor of FP8 weight `name`, which an FP8 output writes anew."""
        if self.compressed is not None:
            return ct.scale_name(name)
        return name + SCALE_SUFFIX

    def describe(self, ckpt: Checkpoint) -> str:
        """In words, for `plan`, the report and the model card."""
        floating = sorted({
            i.dtype for n, i in ckpt.tensors.items()
            if i.dtype in FLOATING and n not in self.companions
        })  # fmt: skip
        plain = "/".join(dtype_name(d) for d in floating) or "no floating-point tensors"
        if self.compressed is not None:
            return self.compressed.describe(plain)
        if self.mxfp4:
            n = len(self.mxfp4)
            return f"MXFP4 (e2m1 codes, an e8m0 scale per 32, {n} weights; the rest {plain})"
        if self.fp8 is None:
            return plain
        bm, bn = self.fp8.block
        n = len(self.fp8.scales)
        return f"fine-grained FP8 (e4m3, {bm}x{bn} blocks, {n} FP8 weights; the rest {plain})"


def recognize(ckpt: Checkpoint) -> Format:
    """The checkpoint's format, or a `CheckpointError` saying why it cannot be merged."""
    quant = ckpt.quantization
    _refuse_packed(ckpt, quant)
    if quant is not None and quant.get("quant_method") == MXFP4:
        return Format(None, _mxfp4_pairs(ckpt))
    if quant is not None and quant.get("quant_method") in (ct.COMPRESSED, ct.FBGEMM):
        return Format(None, compressed=recognize_compressed(ckpt, quant))
    block = _fp8_block(ckpt, quant) if quant is not None else None
    scales: dict[str, TensorInfo] = {}
    for name, info in sorted(ckpt.tensors.items()):
        if not info.dtype.startswith("F8_"):
            continue
        if info.dtype != FP8_DTYPE:
            where = f"tensor {name!r} in {ckpt.describe(name)}"
            raise CheckpointError(
                f"{where} is {info.dtype}: ram-dist merges FP8 only as fine-grained "
                f"{FP8_DTYPE} blocks with a {SCALE_SUFFIX} companion; {DEQUANTIZE}"
            )
        if block is None:
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.describe(name)} is {FP8_DTYPE}, but the "
                "checkpoint's config.json declares no quantization_config {quant_method: "
                "fp8, fmt: e4m3, weight_block_size: [bm, bn]}, so its scales cannot be read; "
                "add it, or " + DEQUANTIZE
            )
        scales[name] = _companion(ckpt, info, block)
    if block is not None and not scales:
        raise CheckpointError(
            f"{ckpt.label} ({ckpt.url}): config.json declares fine-grained FP8 but no tensor "
            f"is {FP8_DTYPE}; fix the config or the checkpoint"
        )
    return Format(Fp8Blocks(block, scales) if block is not None else None)


#: Per merged quant_method, the packed-tensor name endings that are its own.
OWN_SUFFIXES = {
    "fp8": (),
    "mxfp4": (BLOCKS_SUFFIX,),
    "compressed-tensors": (".weight_packed", ".weight_scale"),
    "fbgemm_fp8": (".weight_scale",),
}
MERGED = "floating-point, fine-grained FP8, MXFP4, compressed-tensors and fbgemm_fp8"


def _refuse_packed(ckpt: Checkpoint, quant: Mapping[str, Any] | None) -> None:
    """Any quantization but those merged (`OWN_SUFFIXES`), declared or recognised by its
    tensor names (a format's own packed tensors are its)."""
    method = quant.get("quant_method") if quant is not None else None
    own = OWN_SUFFIXES.get(method, ()) if isinstance(method, str) else ()
    ends = tuple(e for e in PACKED_SUFFIXES if e not in own)
    first = min((n for n in ckpt.tensors if n.endswith(ends)), default=None)
    packed = None
    if first is not None:
        packed = (first, next(f for e, f in PACKED_SUFFIXES.items() if first.endswith(e)))
    if method in OWN_SUFFIXES and packed is None:
        return
    if quant is not None and method not in OWN_SUFFIXES:
        name = packed[0] if packed else _first_not_floating(ckpt)
        what = f"quant_method {method!r}" if method is not None else "a quantization_config"
        first = f"; first quantized tensor {name!r} in {ckpt.describe(name)}" if name else ""
        raise CheckpointError(
            f"{ckpt.label} ({ckpt.url}) is quantized ({what} in its config.json{first}): "
            f"ram-dist merges {MERGED} checkpoints only; " + DEQUANTIZE
        )
    if packed is not None:
        name, fmt = packed
        raise CheckpointError(
            f"tensor {name!r} in {ckpt.describe(name)} is a packed quantized tensor "
            f"({fmt}): ram-dist merges {MERGED} checkpoints only; " + DEQUANTIZE
        )


def _first_not_floating(ckpt: Checkpoint) -> str | None:
    for name, info in sorted(ckpt.tensors.items()):
        if info.dtype not in FLOATING:
            return name
    return None


def _fp8_block(ckpt: Checkpoint, quant: Mapping[str, Any]) -> tuple[int, int]:
    """The block size of a `quant_method: fp8` config, which must be the fine-grained one."""
    where = f"{ckpt.label} ({ckpt.url}): config.json quantization_config"
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(
            f"{where} has fmt {fmt!r}: only e4m3 FP8 is merged; {DEQUANTIZE}"
        )  # fmt: skip
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise CheckpointError(
            f"{where} has activation_scheme {scheme!r}: static activation scales "
            f"(input_scale tensors) cannot be merged; {DEQUANTIZE}"
        )
    block = quant.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{where} has weight_block_size {block!r}: fine-grained FP8 needs two positive "
            f"integers (e.g. [128, 128]); per-tensor or per-channel FP8 is merged in "
            "compressed-tensors' or fbgemm_fp8's form only; " + DEQUANTIZE
        )
    return (block[0], block[1])


def _companion(ckpt: Checkpoint, info: TensorInfo, block: tuple[int, int]) -> TensorInfo:
    """The scale tensor of FP8 weight `info`, checked against its shape."""
    name = info.name
    scale = ckpt.tensors.get(name + SCALE_SUFFIX)
    shape = info.shape
    want = tuple(-(-n // b) for n, b in zip(shape, block, strict=False))
    if scale is not None and len(shape) == 2 and scale.shape == want:
        if scale.dtype in SCALE_DTYPES:
            return scale  # the usual case, checked without composing any message
    where = f"tensor {name!r} in {ckpt.describe(name)}"
    if len(info.shape) != 2:
        raise CheckpointError(
            f"{where} is {FP8_DTYPE} with shape {list(info.shape)}: fine-grained FP8 "
            f"weights are matrices; {DEQUANTIZE}"
        )
    if scale is None:
        raise CheckpointError(
            f"{where} is {FP8_DTYPE} but has no companion {name + SCALE_SUFFIX!r}, so its "
            f"values are unknown; {DEQUANTIZE}"
        )
    if scale.shape != want or scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(
            f"tensor {scale.name!r} in {ckpt.describe(scale.name)} is {scale.dtype} "
            f"{list(scale.shape)}; the scales of {name!r} ({list(info.shape)}, "
            f"{block[0]}x{block[1]} blocks) must be F32 or BF16 of shape {list(want)}"
        )
    return scale


#: `quant_method` of gpt-oss's MXFP4 checkpoints.
MXFP4 = "mxfp4"


def _mxfp4_pairs(ckpt: Checkpoint) -> dict[str, Mxfp4Pair]:
    """Every MXFP4 weight of a checkpoint whose config says `quant_method: mxfp4`, found by
    its tensors' names (gpt-oss's `modules_to_not_convert` lists module globs, not every
    plain tensor: it is not read); each pair checked against the other."""
    pairs: dict[str, Mxfp4Pair] = {}
    for name, info in sorted(ckpt.tensors.items()):
        if name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in (
            ckpt.tensors
        ):
            raise CheckpointError(
                f"tensor {name!r} in {ckpt.describe(name)} has no "
                f"{name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX!r}: an MXFP4 weight is a pair "
                f"of blocks and scales; {DEQUANTIZE}"
            )
        if not name.endswith(BLOCKS_SUFFIX):
            continue
        weight = name[: -len(BLOCKS_SUFFIX)]
        scales = ckpt.tensors.get(weight + SCALES_SUFFIX)
        where = f"tensor {name!r} in {ckpt.describe(name)}"
        if scales is None:
            raise CheckpointError(
                f"{where} has no {weight + SCALES_SUFFIX!r}, so its values are unknown; "
                + DEQUANTIZE
            )
        shape = info.shape
        if info.dtype != MXFP4_DTYPE or len(shape) != 4 or shape[3] != mxfp4.GROUP // 2:
            raise CheckpointError(
                f"{where} is {info.dtype} {list(shape)}: MXFP4 blocks are {MXFP4_DTYPE} of "
                f"shape [experts, rows, groups, 16]; {DEQUANTIZE}"
            )
        if scales.dtype != MXFP4_DTYPE or scales.shape != shape[:3]:
            raise CheckpointError(
                f"tensor {scales.name!r} in {ckpt.describe(scales.name)} is {scales.dtype} "
                f"{list(scales.shape)}; the scales of {name!r} ({list(shape)}) must be "
                f"{MXFP4_DTYPE} of shape {list(shape[:3])}"
            )
        pairs[weight] = Mxfp4Pair(info, scales)
    if not pairs:
        raise CheckpointError(
            f"{ckpt.label} ({ckpt.url}): config.json declares quant_method mxfp4 but no tensor "
            f"is a {BLOCKS_SUFFIX}/{SCALES_SUFFIX} pair; fix the config or the checkpoint"
        )
    return pairs
