"""What the engine needs of a merge rule (the `MergeMethod` protocol). The table of methods
by name is `ram_dist.methods.registry.METHODS`; their parameters are declared in
`ram_dist.methods.parameters`.

A method is a configured instance (as in mergekit: `ties` and `dare_ties` are one family
with other settings). The engine drives it through reduce rounds and a map pass:

* `rounds` reduce rounds; in each, `chunk_statistics` runs on workers for every chunk of the
  tensors `active` in that round and returns int64 tensors keyed by a scope ("" for the whole
  model, or a tensor name); the driver sums them per key and `finalize` folds the sums into
  the method's state (plain data: JSON-able, stored in the manifest for resume).
* `merge_chunk` runs on workers in the map pass with the final state.

Each call on a chunk takes one `ChunkWork` (the chunk, its parameters, the state, the round)
and the chunk's inputs; `finalize` takes one `RoundTotals`.

Both run eagerly on torch tensors (CPU or GPU). A method with fused CPU kernels also offers
`fused_statistics` and `fused_merge`, which take the raw numpy arrays the engine read (no
torch: a CPU worker on the fused path never imports it) and may decline a chunk (None,
False), which then runs eagerly. The engine calls them only where kernels are on, on the
CPU, for inputs the kernels read (`ram_dist.kernels.READS`): a method decides only what is
its own (a statistic its kernel does not compute, a parameter it does not handle), and says
the same ahead of time in `fuses`.

A method module must not import torch at import time (the engine pickles methods to
workers): import it inside the eager functions that need it.

Parameters are resolved per tensor on the driver (`TensorParams`: per-task lists and global
values) and checked before any work starts: each value by its declaration, then by the
method's `check` for what involves several.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from ram_dist.methods.parameters import Parameter

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

#: Resolved parameters of one tensor: per-task parameters as lists (task order), globals as
#: values.
TensorParams = Mapping[str, Any]
State = dict[str, Any]


@dataclass(frozen=True)
class Chunk:
    """Where a chunk lies: its tensor, its first flat index, and the tensor's shape.

    A chunk is what a method computes on at once: one compute block of one tensor, cut by the
    engine from a work unit (the unit's size is the unit budget, `--unit-mb`, a word of the
    engine's only). Where the method asks for `whole_rows`, a chunk starts and ends between
    rows (`row`)."""

    tensor: str
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the whole tensor."""
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Elements in one row (one index of the first dimension; a 1-D tensor is one row)."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else self.numel


@dataclass(frozen=True)
class ChunkWork:
    """What one call of a method on one chunk works with, built by the engine (and by a
    method that drives others, for each of them): the chunk, its tensor's parameters, the
    method's state, and the reduce round with whether to count NaN/Inf (a reduce call) or
    the bits of bfloat16's NaN (a map call). One object, so that no method repeats the
    protocol's argument list."""

    chunk: Chunk
    params: TensorParams
    state: State
    round_: int = 0
    count_nonfinite: bool = False
    """Whether `fused_statistics` should count each input's NaN/Inf from its sweep."""
    bf16_nan: int | None = None
    """The bits of a NaN cast to bfloat16, as the engine probed them (None: the kernel
    probes)."""

    def of(self, params: TensorParams, state: State) -> ChunkWork:
        """The same work with another method's parameters and state (a wrapper's inner
        method, a sweep's variant)."""
        return replace(self, params=params, state=state)


@dataclass(frozen=True)
class RoundTotals:
    """What `finalize` folds into the state at the end of a reduce round, on the driver: the
    round, its statistics summed per key, every tensor's parameters and size, the state."""

    round_: int
    totals: dict[str, Any]
    params: Mapping[str, TensorParams]
    numel: Mapping[str, int]
    state: State


class MergeMethod(Protocol):
    name: str
    label: str
    """How reports and the model card name it, e.g. "RAM+ (clipped linear rescaling, Eq. 6)"."""
    summary: str
    """What it does in one line, for `--method`'s help and the README's table of methods."""
    reference: str
    """The paper the rule comes from, e.g. "Yadav et al. 2023" ("": none)."""
    description: str
    """What the rule does, one paragraph of the model card ("": none)."""
    needs_base: bool
    """Whether it reads a base model (mergekit's `linear` averages the inputs without one)."""
    parameters: tuple[Parameter, ...]
    """What it takes (`methods.parameters.PARAMETERS[name]`); `check` sees what involves
    several of them, each value having been checked by its declaration."""
    rounds: int
    """Reduce rounds before the map pass (0: a method without statistics)."""
    rounds_note: str
    """Why a round may read nothing (plan's report), or ""."""
    reports_overlap: bool
    """Whether the reduce pass counts RAM's overlap statistics (what `probe` reports); for a
    method that does not, `probe` counts them with `ram_plus`'s rule."""

    task_counts: tuple[int, int | None]
    """How many task models (besides the base) it merges: at least, at most (None: any)."""
    reads_stored: bool
    """Whether `fused_statistics` and `fused_merge` take a quantized input as it is stored
    in place of a decoded copy of its values: block FP8 as `kernels.fp8.Fp8Values` (e4m3
    bytes and block scales), MXFP4, packed INT and compressed-tensors' FP8 as
    `kernels.quantized.QuantizedValues` (codes and scales), each value decoded as the
    kernels load it (`primitives.load_span`). Optional: the engine reads it with False as
    the default, and then hands such inputs decoded."""
    statistics_parameters: tuple[str, ...] | None
    """The parameters its reduce statistics depend on (None: every one): a sweep's variants
    of one kind of method that agree on these and on the state compute them once
    (`methods.sweep`). Optional: the engine reads it with None as the default. So is a
    method `statistics_state(round_, state)`: the part of the state a round's statistics
    depend on (without it, all of it), so that variants whose states differ only in what
    the round does not read (TIES's densities in its first round) share the round too."""
    writes_fp8: bool
    """Whether `fused_merge` writes FP8 output itself, into a `kernels.fp8.Fp8Target`
    (blocks and scales in one sweep; it then also `reads_stored`). Optional: the engine
    reads it with False as the default, and then requantizes the merged values itself."""

    def whole_rows(self, params: TensorParams) -> bool:
        """Whether it computes on whole rows of a tensor with these parameters (a rank or a
        norm per row): then every chunk of it starts and ends between rows."""
        ...

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """What the text summary and the model card say of the keys `report` added (one
        line each, plain text), or nothing."""
        ...

    def check(self, params: TensorParams, where: str) -> None: ...

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State: ...

    def active(self, round_: int, state: State, tensor: str) -> bool: ...

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...

    def finalize(self, end: RoundTotals) -> State: ...

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor: ...

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> (
        tuple[dict[str, np.ndarray], list[int] | None]
        | tuple[dict[str, np.ndarray], list[int] | None, np.ndarray | None]
        | None
    ):
        """`chunk_statistics` by a fused kernel (int64 arrays) on the inputs' raw arrays
        (base first), with each input's NaN/Inf count from the same sweep when the work asks
        (`count_nonfinite`) and the kernel has it (else None: the engine counts them); None
        to decline. Where it counts NaN/Inf it may add, third, the chunk's precision check
        from the same sweep (`kernels.precision.check_counts`, int64 [N, 3]; None: the
        engine runs it)."""
        ...

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk(...)` cast to the output dtype, by a fused kernel, written into `out`
        (the output's raw array: bfloat16 as uint16); False to decline. The work's
        `bf16_nan`: the bits of a NaN cast to bfloat16, as the engine probed them (None: the
        kernel probes)."""
        ...

    def fuses(self, params: TensorParams) -> bool:
        """Whether `fused_statistics` and `fused_merge` take every chunk of a tensor with
        these parameters (on dtypes the kernels read): asked on the driver, before any work,
        to choose where the tensor's units run (`planning.devices`: a tensor the fused kernels
        take runs on the CPUs, one that needs the eager rule may go to a GPU)."""
        ...

    def report(self, state: State) -> dict[str, Any]: ...


class Defaults:
    """The protocol's defaults: what a method says of itself unless it says otherwise, and
    the hooks most methods leave as they are. Every method class derives from it (through
    `Eager` where it has no fused kernels), so that no method repeats them."""

    rounds_note: str = ""
    reports_overlap: bool = False
    summary: str = ""
    reference: str = ""
    description: str = ""
    needs_base: bool = True
    task_counts: tuple[int, int | None] = (2, None)
    reads_stored: bool = False
    writes_fp8: bool = False
    statistics_parameters: tuple[str, ...] | None = None

    @property
    def label(self) -> str:
        return str(getattr(self, "name", type(self).__name__))

    def whole_rows(self, params: TensorParams) -> bool:
        return False

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        return []

    def check(self, params: TensorParams, where: str) -> None:
        """Nothing beyond each value's own check by its declaration."""
        return None


class Eager(Defaults):
    """What a method without fused kernels says to the engine's fused path: no."""

    def fuses(self, params: TensorParams) -> bool:
        return False

    def fused_statistics(self, work: ChunkWork, inputs: Sequence[np.ndarray]) -> None:
        return None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        return False


class NoStatistics(Eager):
    """The rest of the protocol for a method that is a rule of each element alone (no reduce
    round, no parameter, nothing to report): such a method only names itself and gives
    `merge_chunk` (see `docs/extending.md`)."""

    parameters: tuple[Parameter, ...] = ()
    rounds: int = 0

    def initial_state(self, *args: Any) -> State:
        return {}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return False

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {}

    def finalize(self, end: RoundTotals) -> State:
        return end.state

    def report(self, state: State) -> dict[str, Any]:
        return {}


#: What the model card says of a method computed as mergekit computes it.
MERGEKIT_TEXT = (
    "`{name}`, computed as mergekit computes it (float32), streamed unit by unit on Ray."
)


class MergekitRule:
    """What a method computed as mergekit computes it says of itself (`description`)."""

    name: str

    @property
    def description(self) -> str:
        return MERGEKIT_TEXT.format(name=self.name)
