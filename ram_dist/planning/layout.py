"""Check that the inputs fit together and describe every tensor for the workers.

Runs on the driver, on headers only, before any tensor byte is read: a task missing a base
tensor, holding an extra one, or with another shape stops the job here, naming the model,
the tensor and the file.

Each input's stored form of a tensor is a source (`planning.sources`): it says what a unit
reads and how the bytes read become the values merged, whatever the input's format. A
fine-grained FP8 weight (`planning.formats`) is one tensor here: its sources say where its
e4m3 bytes and its scales lie, the workers merge its dequantized values, and, when
the output is FP8 again, its companion scale tensor is an output tensor of its own that
follows the weight in its shard (`TensorEntry.scale_of`): the same unit can then write both.
Work units cut such a weight only at whole bands of `bm` rows, the blocks' height.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ram_dist.dtypes import FLOATING, dtype_name, itemsize
from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo
from ram_dist.io.storage import join
from ram_dist.io.writer import OutTensor
from ram_dist.planning.adapters import adapter_sources, lora_config
from ram_dist.planning.formats import FP8_DTYPE, Format, recognize
from ram_dist.planning.sources import (
    FP8_VALUES_DTYPE,
    Fp8Source,
    Source,
    TensorSource,
    same_as_base,
)
from ram_dist.planning.tensor_names import check_names
from ram_dist.planning.units import TensorSlot, WorkUnit


@dataclass(frozen=True)
class Fp8Out:
    """An FP8 output weight: its block size and its companion scale tensor (name, dtype).
    The blocks tile the weight as rows of `cols` (its last axis); a band of them is `rows`
    of the tensor's own rows (its first axis): `block[0]` for a matrix, 1 for a 3-D weight
    whose band is one expert (`sources.Fp8ExpertSource`)."""

    block: tuple[int, int]
    scale_name: str
    scale_dtype: str
    cols: int
    rows: int

    @property
    def per_band(self) -> int:
        """Scales per band: the length of one row of the scale tensor's [bands, per_band]."""
        return -(-self.cols // self.block[1])


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the workers see it: its inputs (base first) and its output dtype."""

    name: str
    shape: tuple[int, ...]
    participating: bool
    out_dtype: str
    sources: tuple[TensorSource, ...]
    """Each input's stored form of the tensor (`planning.sources`), base first."""
    fp8_out: Fp8Out | None = None
    """Written as FP8 blocks again (and its companion `fp8_out.scale_name` with it)."""
    scale_of: str | None = None
    """This output tensor is the new scales of that FP8 weight: it reads no input of its
    own; the weight's bands, merged, give it."""
    whole_rows: bool = False
    """The method computes on whole rows of it (`MergeMethod.whole_rows`): units and compute
    blocks cut it only between rows (a 1-D tensor is one row)."""

    @property
    def merged_dtype(self) -> str:
        """The dtype the merge rule writes: the output dtype, or `FP8_VALUES_DTYPE` for a
        weight written as FP8 (quantized afterwards)."""
        return FP8_VALUES_DTYPE if self.fp8_out is not None else self.out_dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def band(self) -> int | None:
        """Elements of the rows units and compute blocks cut only between (`atomic_rows`
        whole rows: an FP8 band); None for a tensor that may be cut anywhere."""
        rows = self.atomic_rows
        if rows is None:
            return None
        return rows * math.prod(self.shape[1:]) if len(self.shape) > 1 else self.numel

    @property
    def atomic_rows(self) -> int | None:
        """Rows cut only together: the least common multiple of the output's FP8 blocks'
        height, when it is written as FP8, and every input's (`TensorSource.atomic_rows`),
        so that a cut is at a band of each (a base and a task with FP8 blocks of other
        heights), and 1 where the method computes on whole rows; None when nothing is cut
        only at some rows."""
        rows = [s.atomic_rows for s in self.sources if s.atomic_rows is not None]
        if self.whole_rows:
            rows.append(1)
        if self.fp8_out is not None:
            rows.append(self.fp8_out.rows)
        return math.lcm(*rows) if rows else None


@dataclass(frozen=True)
class Layout:
    """Every tensor, and the output shards (base's file names, base's tensor order)."""

    tensors: dict[str, TensorEntry]
    shards: dict[str, tuple[str, ...]]
    sharded: bool
    formats: tuple[str, ...] = ()
    """Each input's storage format in words (`formats.Format.describe`), base first."""
    decoded_inputs: bool = False
    """Whether any input's values are decoded from what it stores (FP8 weights): how they
    are decoded decides the bytes, so the formats are part of the job's identity then."""
    dropped: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per task (by label), the tensors it holds that the base does not, left out as asked
    (`--drop-extra-tensors`)."""

    def output_format(self) -> str:
        """The output's storage format in words, as `formats` says the inputs'."""
        merged = [e for e in self.tensors.values() if e.participating]
        fp8 = [e for e in merged if e.fp8_out is not None]
        plain = sorted({e.out_dtype for e in merged if e.fp8_out is None})
        words = "/".join(dtype_name(d) for d in plain) or "no floating-point tensors"
        if not fp8:
            return words
        blocks = {e.fp8_out.block for e in fp8}  # type: ignore[union-attr]
        if any(not e.fp8_out.scale_name.endswith("_scale_inv") for e in fp8):  # type: ignore[union-attr]
            scales = "a scale per row or tensor, as the base's"
            return f"FP8 (e4m3, {scales}, {len(fp8)} FP8 weights with new scales; the rest {words})"
        bm, bn = blocks.pop()
        return (
            f"fine-grained FP8 (e4m3, {bm}x{bn} blocks, {len(fp8)} FP8 weights with new "
            f"scales; the rest {words})"
        )

    def config_dtype(self, out_dtype: str | None) -> str | None:
        """The dtype the output's config.json names, dropping the base's quantization_config
        (`io.non_weight_files.copy_files`): `out_dtype` when given; else, where the base has
        decoded weights none of which is written quantized again (an MXFP4 base: its weights
        in bfloat16), the one dtype of the merged tensors; else None (the base's config as it
        is)."""
        if out_dtype is not None:
            return out_dtype
        merged = [e for e in self.tensors.values() if e.participating]
        if any(e.fp8_out is not None for e in merged):
            return None
        if not any(e.sources[0].decoded for e in merged):
            return None
        dtypes = {e.out_dtype for e in merged}
        return dtypes.pop() if len(dtypes) == 1 else None

    def out_tensors(self, shard: str) -> list[OutTensor]:
        return [
            OutTensor(n, self.tensors[n].out_dtype, self.tensors[n].shape)
            for n in self.shards[shard]
        ]

    def in_whole_rows(self, names: Iterable[str]) -> Layout:
        """This layout with `names` cut only between rows (`TensorEntry.whole_rows`)."""
        tensors = dict(self.tensors)
        for name in names:
            tensors[name] = replace(tensors[name], whole_rows=True)
        return replace(self, tensors=tensors)

    def slots(self) -> list[TensorSlot]:
        """Planner input, in output order; copied tensors read the base only. A new scale
        tensor costs, per element, the block of its weight it is computed from (nothing
        when it follows its whole weight in one unit)."""
        slots = []
        for shard, names in self.shards.items():
            for n in names:
                e = self.tensors[n]
                if e.scale_of is not None:
                    w = self.tensors[e.scale_of]
                    assert w.fp8_out is not None
                    bm, bn = w.fp8_out.block
                    cost = bm * bn * max(s.itemsize for s in w.sources)
                    row = w.fp8_out.per_band
                    slots.append(TensorSlot(n, shard, e.numel, row, cost, True, e.scale_of))
                    continue
                used = e.sources if e.participating else e.sources[:1]
                row = math.prod(e.shape[1:]) if len(e.shape) > 1 else 1
                widest = max(s.itemsize for s in used)  # a task reading the base's: as much
                band = e.band
                if band is not None:
                    slots.append(TensorSlot(n, shard, e.numel, band, widest, True))
                else:
                    slots.append(TensorSlot(n, shard, e.numel, row, widest))
        return slots

    def atomic_rows(self, shard: str) -> dict[str, int]:
        """Per tensor of `shard` that units cut only between rows, its row in elements."""
        rows = {}
        for name in self.shards[shard]:
            e = self.tensors[name]
            if e.scale_of is not None:
                w = self.tensors[e.scale_of]
                assert w.fp8_out is not None
                rows[name] = w.fp8_out.per_band
            elif e.band is not None:
                rows[name] = e.band
        return rows

    def read_bytes(self, tensor: str, numel: int) -> float:
        """Bytes `numel` elements of `tensor` read from all inputs together: a copied tensor
        reads the base only; a new scale tensor, its weight's blocks (scales left out). A
        fraction where a packed input's bytes are shared by several elements."""
        e = self.tensors[tensor]
        if e.scale_of is not None:
            w = self.tensors[e.scale_of]
            assert w.fp8_out is not None
            bm, bn = w.fp8_out.block
            per = min(bm * bn, w.numel)
            return numel * per * sum(s.itemsize for s in w.sources)
        sources = e.sources if e.participating else e.sources[:1]
        same = same_as_base(sources)
        return numel * sum(s.itemsize for i, s in enumerate(sources) if not same[i])


def unit_out_bytes(unit: WorkUnit, layout: Layout) -> int:
    """Bytes a unit's merged pieces take in the output shard."""
    return sum(p.numel * itemsize(layout.tensors[p.tensor].out_dtype) for p in unit.pieces)


def build_layout(
    base: Checkpoint, tasks: list[Checkpoint], out_dtype: str | None, drop_extra: bool = False
) -> Layout:
    """Validate names, shapes and dtype kinds of all inputs against the base. An FP8 weight
    with its scales counts as one floating tensor of its checkpoint: the base and each task
    may store it in FP8 or not, each on its own. A task given as a LoRA adapter
    (`planning.adapters`) has a source for every base tensor: a product, its own copy, or
    the base's. `drop_extra`: a task's tensors the base lacks are left out (and listed in
    `Layout.dropped`) instead of refused."""
    if base.adapter is not None:
        raise CheckpointError(
            f"the {base.label} ({base.url}) is a PEFT adapter folder: give the model it was "
            "trained on as the base, and the adapter as a task"
        )
    base_fmt = recognize(base)
    base_view = base_fmt.view(base)
    base_sources = {n: base_fmt.source(i) for n, i in base_view.items()}
    formats: list[Format | None] = [base_fmt]
    views: list[dict[str, TensorInfo]] = []
    words = [base_fmt.describe(base)]
    adapted: list[dict[str, TensorSource] | None] = []
    dropped: dict[str, tuple[str, ...]] = {}
    for task in tasks:
        if task.adapter is not None:
            config = lora_config(task)
            adapted.append(adapter_sources(base, base_view, base_sources, task, config))
            formats.append(None)
            views.append({})
            words.append(config.describe())
            continue
        fmt = recognize(task)
        views.append(fmt.view(task))
        extra = check_names(base, base_view, task, views[-1], drop_extra)
        if extra:
            dropped[task.label] = extra
        adapted.append(None)
        formats.append(fmt)
        words.append(fmt.describe(task))
    tensors: dict[str, TensorEntry] = {}
    for name, b in base_view.items():
        sources = (
            (base_sources[name],)
            + tuple(
                own[name] if own is not None else fmt.source(view[name])  # type: ignore[union-attr]
                for view, own, fmt in zip(views, adapted, formats[1:], strict=True)
            )
        )
        merged = [_merged(src) for src in sources]
        for task, view, own, src, merges in zip(
            tasks, views, adapted, sources[1:], merged[1:], strict=True
        ):
            info = view[name] if own is None else None
            if info is not None and info.shape != b.shape:
                raise CheckpointError(
                    f"tensor {name!r}: shape {list(info.shape)} in {task.describe(name)} "
                    f"differs from {list(b.shape)} in {base.describe(name)}"
                )
            if merges != merged[0]:
                raise CheckpointError(
                    f"tensor {name!r}: dtype {info.dtype if info else src.values_dtype} in "
                    f"{task.describe(name)} and "
                    f"{b.dtype} in {base.describe(name)} are not both floating point"
                )
        participating = merged[0]
        fp8_out = None
        if isinstance(sources[0], Fp8Source) and out_dtype is None:  # written as the base is
            src = sources[0]
            fp8_out = Fp8Out(
                src.block, base_fmt.scale_name(name), src.scale_dtype, src.cols,
                src.atomic_rows or 1,
            )  # fmt: skip
            _check_band_heights(name, base, tasks, sources, fp8_out)
        tensors[name] = TensorEntry(
            name=name,
            shape=b.shape,
            participating=participating,
            out_dtype=_out_dtype(b, participating, fp8_out, out_dtype),
            sources=sources,
            fp8_out=fp8_out,
        )
        if fp8_out is not None:
            scale_info = base.tensors[fp8_out.scale_name]
            tensors[fp8_out.scale_name] = TensorEntry(
                name=fp8_out.scale_name,
                shape=scale_info.shape,
                participating=False,
                out_dtype=scale_info.dtype,
                sources=(Source(scale_info.file, scale_info.start, scale_info.dtype),),
                scale_of=name,
            )
    shards: dict[str, tuple[str, ...]] = {}
    by_file: dict[str, list[TensorInfo]] = {}
    for info in {**base.tensors, **base_view}.values():  # an MXFP4 weight at its blocks'
        by_file.setdefault(info.file, []).append(info)
    for file in base.files:
        in_file = sorted(by_file.get(join(base.url, file), []), key=lambda i: i.start)
        names = [i.name for i in in_file if i.name in tensors]
        shards[file] = tuple(_scales_after_weights(names, tensors))
    return Layout(
        tensors=tensors,
        shards={f: n for f, n in shards.items() if n},
        sharded=base.sharded,
        formats=tuple(words),
        decoded_inputs=any(f is None or f.decodes for f in formats),
        dropped=dropped,
    )


def _check_band_heights(
    name: str,
    base: Checkpoint,
    tasks: list[Checkpoint],
    sources: tuple[TensorSource, ...],
    fp8_out: Fp8Out,
) -> None:
    """An FP8 weight written as FP8 again is cut at its output blocks' rows, so every FP8
    input's blocks must fit in them: a task's block height must divide the base's."""
    height = fp8_out.rows
    for task, src in zip(tasks, sources[1:], strict=True):
        rows = src.atomic_rows
        if rows is not None and height % rows:
            raise CheckpointError(
                f"tensor {name!r}: FP8 blocks of {rows} rows in {task.describe(name)} do not "
                f"fit the {height}-row blocks of the {base.describe(name)}, which the output "
                "keeps; pass --out-dtype bfloat16 (then any block sizes merge), or dequantize "
                "the task"
            )


def _out_dtype(
    base: TensorInfo, participating: bool, fp8_out: Fp8Out | None, out_dtype: str | None
) -> str:
    """A merged tensor's: FP8 again, the configured dtype, or the base's; a copy's: the
    base's."""
    if not participating:
        return base.dtype
    return FP8_DTYPE if fp8_out is not None else out_dtype or base.dtype


def _merged(src: TensorSource) -> bool:
    """Whether an input's tensor takes part in the merge: its values are floating point (an
    FP8 weight's are float32; a lone F8 tensor is refused by `formats.recognize` first)."""
    return src.values_dtype in FLOATING


def _scales_after_weights(names: list[str], tensors: dict[str, TensorEntry]) -> list[str]:
    """A shard's output order: the base's, except that a new scale tensor follows its FP8
    weight when both are in this shard (the scales are computed from the weight's bands)."""
    here = set(names)
    moved = {
        n for n in names
        if tensors[n].scale_of is not None and tensors[n].scale_of in here
    }  # fmt: skip
    order: list[str] = []
    for n in names:
        if n in moved:
            continue
        order.append(n)
        fp8_out = tensors[n].fp8_out
        if fp8_out is not None and fp8_out.scale_name in moved:
            order.append(fp8_out.scale_name)
    return order
