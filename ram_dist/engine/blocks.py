"""Reading a unit's inputs, block by block: the byte ranges of every input a piece needs,
read into reused buffers by a thread while the caller computes the block before (small
tensors grouped into one request), each input's values decoded as its source says
(`planning.sources`: FP8 blocks dequantized) when they are asked for: a fused kernel that
reads an input as stored (RAM's, on FP8) never has it decoded. Runs on Ray workers.

A CPU worker on the fused path never imports torch: the kernels read the numpy arrays;
torch is loaded where the eager rule or a GPU runs, the first time it does."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ram_dist import kernels
from ram_dist.engine.worker import WorkScope
from ram_dist.io.storage import Storage
from ram_dist.planning.layout import Layout, TensorEntry
from ram_dist.planning.sizing import COMPUTE_BLOCK
from ram_dist.planning.sources import Arrays, Base, Floats, Range, TensorSource, same_as_base
from ram_dist.planning.units import Piece

if TYPE_CHECKING:
    import torch


def inputs_of(entry: TensorEntry) -> int:
    """Inputs a tensor reads: all (merged), the base (copied), none (new FP8 scales)."""
    if entry.scale_of is not None:
        return 0
    return len(entry.sources) if entry.participating else 1


def _ranges(entry: TensorEntry, start: int, stop: int) -> tuple[list[Range], list[int]]:
    """The byte ranges of elements [start, stop) of a tensor in every input it needs (base
    first; only the base for a tensor that is copied), and the input each belongs to: each
    source's first range (its stored elements) in input order, then each one's second (an
    FP8 input's scale rows), and so on, so that the stored elements lead as they always
    have. A task whose source is the base's own reads nothing (`same_as_base`). Elements
    [start, stop) are whole atomic rows of every source."""
    sources = entry.sources[: inputs_of(entry)]
    same = same_as_base(sources)
    per = [[] if same[i] else src.ranges(start, stop) for i, src in enumerate(sources)]
    out: list[Range] = []
    owner: list[int] = []
    for k in range(max(map(len, per), default=0)):
        for i, r in enumerate(per):
            if k < len(r):
                out.append(r[k])
                owner.append(i)
    return out, owner


def band_span(entry: TensorEntry, start: int, stop: int) -> tuple[int, int]:
    """The bands [first, last) (runs of atomic rows, `TensorEntry.band`) that elements
    [start, stop) of a tensor cover, such as an FP8 weight's."""
    band = entry.band
    assert band is not None and start % band == 0, f"{entry.name}: not cut at a band"
    return start // band, -(-stop // band)


def input_count(layout: Layout) -> int:
    return max(len(e.sources) for e in layout.tensors.values())


@dataclass(frozen=True)
class Block:
    """Elements [lo, hi) of one piece of a unit: what is read and computed at once."""

    piece: int
    lo: int
    hi: int


class BlockInputs:
    """One block's inputs as read (base first; only the base for a tensor that is copied):
    each input's values, as a byte array over the read buffer, and their safetensors dtype.
    The arrays are valid until the block after the next is read.

    An input whose values are decoded (`TensorSource.decoded`) and that a kernel can read
    in its stored form (`TensorSource.encoded`: an FP8 input's e4m3 bytes and scales, an
    MXFP4 or packed INT input's codes and scales) is decoded only when its values are asked
    for (`raw`, `tensors`, `arrays()`): a fused kernel that reads the stored form
    (`arrays(encoded=True)`) never makes the copy of the values."""

    __slots__ = ("_decode", "_raw", "dtypes", "encoded", "stored")

    def __init__(
        self,
        raw: Sequence[np.ndarray | None],
        dtypes: tuple[str, ...],
        stored: tuple[tuple[np.ndarray, ...] | None, ...] = (),
        encoded: tuple[object | None, ...] = (),
        decode: Sequence[Callable[[], np.ndarray] | None] = (),
    ) -> None:
        self._raw = raw if isinstance(raw, list) else list(raw)
        self.dtypes = dtypes
        self.stored = stored
        """Per input whose values are decoded: the arrays read for it (an FP8 input's e4m3
        bytes and raw scale bytes); None for any other input. Empty when none is."""
        self.encoded = encoded
        """Per input: its stored form as a kernel reads it (`TensorSource.encoded`), or
        None. Empty when no input has one."""
        self._decode = decode

    @property
    def raw(self) -> tuple[np.ndarray, ...]:
        """Every input's values as bytes (decoding those not decoded yet)."""
        return tuple(self.value(i) for i in range(len(self._raw)))

    def value(self, i: int) -> np.ndarray:
        """Input i's values as bytes, decoded the first time they are asked for."""
        got = self._raw[i]
        if got is None:
            decode = self._decode[i]
            assert decode is not None
            got = self._raw[i] = decode()
        return got

    def arrays(self, encoded: bool = False) -> list[Any]:
        """The inputs as the fused kernels read them (`ram_dist.kernels.READS`); with
        `encoded`, an input that has a stored form a kernel reads (`encoded`) as that form,
        undecoded."""
        forms = self.encoded if encoded and self.encoded else (None,) * len(self._raw)
        return [
            form if form is not None else self.value(i).view(kernels.READS[d])
            for i, (form, d) in enumerate(zip(forms, self.dtypes, strict=True))
        ]

    def tensors(self, dev: str) -> list[torch.Tensor]:
        """The inputs as torch tensors on `dev`, for the eager rule (this imports torch)."""
        return [
            tensor_from_bytes(r, d).to(dev, non_blocking=True)
            for r, d in zip(self.raw, self.dtypes, strict=True)
        ]


#: A tensor that reads at most this many bytes from each input is small (`_groupable`).
SMALL_BYTES = 64 * 2**10


#: Blocks of small tensors read together: at most this many, of at most `GROUP_BYTES` in all.
GROUP_BLOCKS = 4096


GROUP_BYTES = 4 * 2**20


def _groupable(entry: TensorEntry) -> bool:
    """Whether a tensor's blocks may be read together with their neighbours' (one
    `read_ranges` call for the group): a small tensor, at most `SMALL_BYTES` from each input.
    A block of a tensor that is not is read on its own, and so is every block of a weight in
    atomic rows or with a decoded input (an FP8 weight: its scales are read with it, its
    values dequantized) and of new FP8 scales (made from their weight's bands)."""
    if entry.scale_of is not None or entry.band is not None:
        return False
    same = same_as_base(entry.sources)
    if any(s.decoded and not same[i] for i, s in enumerate(entry.sources)):
        return False
    return all(entry.numel * s.itemsize <= SMALL_BYTES for s in entry.sources)


def _groups(blocks: list[Block], pieces: tuple[Piece, ...], layout: Layout) -> list[range]:
    """`blocks` cut into runs read at once: consecutive blocks of small tensors (at most
    `GROUP_BLOCKS`, `GROUP_BYTES`), every other block alone."""
    groups: list[range] = []
    first, size, small = 0, 0, False
    for k, block in enumerate(blocks):
        entry = layout.tensors[pieces[block.piece].tensor]
        if not _groupable(entry):
            groups += [range(first, k)] if small else []
            groups.append(range(k, k + 1))
            first, size, small = k + 1, 0, False
            continue
        width = sum(src.itemsize for src in entry.sources[: inputs_of(entry)])
        nbytes = (block.hi - block.lo) * width
        if small and (k - first >= GROUP_BLOCKS or size + nbytes > GROUP_BYTES):
            groups.append(range(first, k))
            first, size = k, 0
        size += nbytes
        small = True
    if small:
        groups.append(range(first, len(blocks)))
    return groups


class BlockStream:
    """Each compute block of `pieces` with its inputs, in order, as it is iterated. A thread
    reads the next group of blocks (`_groups`: small tensors together, in one `read_ranges`
    call) while the caller computes this one's (reads and the fused kernels release the
    GIL), into one of the scope's two read buffers: a block's inputs are valid until the
    caller asks for the block after it. `bytes_read[i]` grows by what is read from input
    i. What an input's source needs of a tensor whatever the elements (a LoRA factor) is
    read once and kept until the stream moves to another tensor."""

    def __init__(
        self,
        pieces: tuple[Piece, ...],
        layout: Layout,
        storage: Storage,
        bytes_read: list[int],
        scope: WorkScope,
        pinned: bool = False,
    ) -> None:
        self._pieces = pieces
        self._layout = layout
        self._storage = storage
        self._bytes_read = bytes_read
        self._scope = scope
        self._pinned = pinned
        self._blocks = [
            Block(p, lo, hi)
            for p, piece in enumerate(pieces)
            for lo, hi in _blocks(piece.numel, layout.tensors[piece.tensor])
        ]
        self._groups = _groups(self._blocks, pieces, layout)
        self._unit: dict[tuple[str, int], list[np.ndarray]] = {}

    def __iter__(self) -> Iterator[tuple[Block, BlockInputs]]:
        if not self._blocks:
            return
        clock, groups = self._scope.clock, self._groups
        if len(groups) == 1:  # nothing to read ahead: no thread to start (and join) for it
            with clock.timing("read_wait_s"):
                inputs = self._timed_read(0)
            self._scope.memory.note()
            for k, block_inputs in zip(groups[0], inputs, strict=True):
                with clock.timing("compute_s"):
                    yield self._blocks[k], block_inputs
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ram-dist-read") as reader:
            ahead = reader.submit(self._timed_read, 0)
            for g, group in enumerate(groups):
                with clock.timing("read_wait_s"):
                    inputs = ahead.result()
                if g + 1 < len(groups):
                    ahead = reader.submit(self._timed_read, g + 1)
                self._scope.memory.note()
                for k, block_inputs in zip(group, inputs, strict=True):
                    with clock.timing("compute_s"):
                        yield self._blocks[k], block_inputs

    def _timed_read(self, g: int) -> list[BlockInputs]:
        with self._scope.clock.timing("read_s"):
            return self._read(g)

    def _unit_arrays(self, tensor: str, i: int, src: TensorSource) -> list[np.ndarray]:
        """What input i's source needs of `tensor` whatever the elements (a LoRA factor),
        read once per unit: kept until the stream moves to another tensor."""
        key = (tensor, i)
        if key not in self._unit:
            if any(t != tensor for t, _ in self._unit):
                self._unit.clear()
            requests = src.unit_ranges()
            arrays = [np.empty(end - start, dtype=np.uint8) for _, start, end in requests]
            if requests:
                self._storage.read_ranges(
                    requests, into=[memoryview(a) for a in arrays], traffic=self._scope.traffic
                )
            self._bytes_read[i] += sum(a.size for a in arrays)
            self._unit[key] = arrays
        return self._unit[key]

    def _views(self, slot: int, requests: list[Range]) -> list[np.ndarray]:
        """`requests` read into the scope's read buffer `slot`."""
        sizes = [end - start for _, start, end in requests]
        arrays = self._scope.reads.views(slot, sizes, self._pinned)
        self._storage.read_ranges(
            requests, into=[memoryview(a) for a in arrays], traffic=self._scope.traffic
        )
        return arrays

    def _read_one(self, k: int, slot: int) -> BlockInputs:
        """A block read on its own, its inputs decoded where their sources say so."""
        block = self._blocks[k]
        piece = self._pieces[block.piece]
        entry = self._layout.tensors[piece.tensor]
        sources = entry.sources[: inputs_of(entry)]
        if not sources:  # new FP8 scales: made from their weight's bands, read nothing
            return BlockInputs((), ())
        start, stop = piece.start + block.lo, piece.start + block.hi
        requests, owner = _ranges(entry, start, stop)
        arrays = self._views(slot, requests)
        for i, a in zip(owner, arrays, strict=True):
            self._bytes_read[i] += a.size
        read: list[list[np.ndarray]] = [[] for _ in sources]
        for i, a in zip(owner, arrays, strict=True):
            read[i].append(a)
        for i, src in enumerate(sources):
            if src.decoded:
                read[i] += self._unit_arrays(piece.tensor, i, src)
        floats = self._scope.reads.floats
        scope, tensor = self._scope, piece.tensor

        def form(i: int, src: TensorSource, got: Arrays, part: Floats, base: Base) -> np.ndarray:
            """Input i's values computed from what was read: a costly source's (a LoRA
            product) taken as an earlier pass kept them where it did, else formed, and kept
            for the passes after this one where the budget has room (`engine.kept_values`)."""
            if not src.costly:
                return src.decode(start, stop, got, part, base)
            key, kept = (tensor, start, stop, i), scope.kept
            if kept is not None:
                taken = kept.take(key, part(stop - start).view(np.uint8))
                if taken is not None:
                    scope.products.reused += stop - start
                    return taken
            values = src.decode(start, stop, got, part, base)
            scope.products.formed += stop - start
            if kept is not None:
                kept.keep(key, values)
            return values

        return _decoded(
            sources, (start, stop), read, lambda i: functools.partial(floats, (slot, i)), form
        )

    def _read(self, g: int) -> list[BlockInputs]:
        group = self._groups[g]
        if len(group) == 1:
            return [self._read_one(group[0], g % 2)]
        requests: list[Range] = []
        dtypes: list[tuple[tuple[str, ...], tuple[bool, ...]]] = []
        for block in (self._blocks[k] for k in group):
            piece = self._pieces[block.piece]
            entry = self._layout.tensors[piece.tensor]
            lo, hi = piece.start + block.lo, piece.start + block.hi
            # a small tensor's inputs are plain (`_groupable`): one range each, in order,
            # none for a task whose source is the base's own
            sources = entry.sources[: inputs_of(entry)]
            same = same_as_base(sources)
            requests += [s.ranges(lo, hi)[0] for i, s in enumerate(sources) if not same[i]]
            dtypes.append((tuple(s.dtype for s in sources), tuple(same)))
        arrays = self._views(g % 2, requests)
        out, at = [], 0
        for types, same in dtypes:
            raw: list[np.ndarray] = []
            for i, is_base in enumerate(same):
                if is_base:
                    raw.append(raw[0])
                    continue
                raw.append(arrays[at])
                self._bytes_read[i] += arrays[at].size
                at += 1
            out.append(BlockInputs(tuple(raw), types))
        return out


def _decoded(
    sources: Sequence[TensorSource],
    span: tuple[int, int],
    read: list[list[np.ndarray]],
    floats_of: Callable[[int], Floats],
    form: Callable[[int, TensorSource, Arrays, Floats, Base], np.ndarray],
) -> BlockInputs:
    """A block's inputs (elements `span`) from what was read for each (`read[i]`: the
    block's ranges, then the unit's), each decoded one's values made from it
    (`TensorSource.decode`: an FP8 input's, the spec's one multiplication per element, when
    they are first asked for, into `floats_of(i)`; a LoRA task's, from the base's values,
    now, by `form`: from a quantized base's stored form, with no copy of its values, or as
    an earlier pass kept them), and a task whose source is the base's own given the base's
    values."""
    start, stop = span
    same = same_as_base(sources)
    dtypes = tuple(s.values_dtype for s in sources)
    raw: list[np.ndarray | None] = []
    decode: list[Callable[[], np.ndarray] | None] = []
    kept: list[tuple[np.ndarray, ...] | None] = []
    forms: list[object | None] = []
    inputs = BlockInputs(raw, dtypes, decode=decode)  # holds the lists filled below
    for i, (src, got) in enumerate(zip(sources, read, strict=True)):
        encoded = src.encoded(start, stop, got) if src.decoded and not same[i] else None
        part = floats_of(i)
        if same[i]:
            raw.append(None)
            decode.append(functools.partial(inputs.value, 0))
            kept.append(None)
            forms.append(forms[0])
        elif encoded is not None:  # decoded when its values are asked for
            raw.append(None)
            decode.append(functools.partial(src.decode, start, stop, got, part, None))
            kept.append(tuple(got))
            forms.append(encoded)
        elif src.decoded:
            # the base decodes from its own bytes; a task computed from the base's values (a
            # LoRA product) gets a quantized base as stored, and decodes it as it loads it
            base = (forms[0] if forms[0] is not None else inputs.value(0)) if i else got[0]
            raw.append(form(i, src, got, part, base))
            decode.append(None)
            kept.append(tuple(got))
            forms.append(None)
        else:
            raw.append(got[0])
            decode.append(None)
            kept.append(None)
            forms.append(None)
    if any(s.decoded for s in sources):
        inputs.stored, inputs.encoded = tuple(kept), tuple(forms)
    return inputs


def tensor_from_bytes(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor over the bytes (no copy); a dtype this torch build lacks is only ever
    copied, byte for byte, so it is read as bytes."""
    import torch

    from ram_dist.dtypes import SAFETENSORS_DTYPES

    data = torch.from_numpy(raw)
    return data.view(SAFETENSORS_DTYPES.get(dtype, torch.uint8))


def _blocks(numel: int, entry: TensorEntry) -> list[tuple[int, int]]:
    """Split a piece into compute blocks, so float temporaries stay small whatever the unit
    budget (the rule is element-wise: the split changes no byte). A weight with FP8 blocks
    is split at whole bands (at least one a block); new scales are one block, reading
    nothing."""
    if entry.scale_of is not None:
        return [(0, numel)] if numel else []
    step = COMPUTE_BLOCK
    if entry.band is not None:
        step = max(1, COMPUTE_BLOCK // entry.band) * entry.band
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
