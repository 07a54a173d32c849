"""What the engine needs of a merge rule (the `MergeMethod` protocol). The table of methods
by name is `ram_dist.methods.METHODS`; their parameters are declared in
`ram_dist.methods.parameters`.

A method is a configured instance (as in mergekit: `ties` and `dare_ties` are one family
with other settings). The engine drives it through reduce rounds and a map pass:

* `rounds` reduce rounds; in each, `chunk_statistics` runs on workers for every chunk of the
  tensors `active` in that round and returns int64 tensors keyed by a scope ("" for the whole
  model, or a tensor name); the driver sums them per key and `finalize` folds the sums into
  the method's state (plain data: JSON-able, stored in the manifest for resume).
* `merge_chunk` runs on workers in the map pass with the final state.

Parameters are resolved per tensor on the driver (`TensorParams`: per-task lists and global
values) and checked before any work starts: each value by its declaration, then by the
method's `check` for what involves several.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ram_dist.methods.parameters import Parameter

#: Resolved parameters of one tensor: per-task parameters as lists (task order), globals as
#: values.
TensorParams = Mapping[str, Any]
State = dict[str, Any]


@dataclass(frozen=True)
class Chunk:
    """Where a chunk lies: its tensor, its first flat index, and the tensor's size."""

    tensor: str
    start: int
    numel: int


class MergeMethod(Protocol):
    name: str
    parameters: tuple[Parameter, ...]
    """What it takes (`methods.parameters.PARAMETERS[name]`); `check` sees what involves
    several of them, each value having been checked by its declaration."""
    rounds: int

    def check(self, params: TensorParams, where: str) -> None: ...

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State: ...

    def active(self, round_: int, state: State, tensor: str) -> bool: ...

    def chunk_statistics(
        self,
        round_: int,
        chunk: Chunk,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: TensorParams,
        state: State,
    ) -> dict[str, torch.Tensor]: ...

    def finalize(
        self,
        round_: int,
        totals: dict[str, torch.Tensor],
        params: Mapping[str, TensorParams],
        numel: Mapping[str, int],
        state: State,
    ) -> State: ...

    def merge_chunk(
        self,
        chunk: Chunk,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: TensorParams,
        state: State,
    ) -> torch.Tensor: ...

    def report(self, state: State) -> dict[str, Any]: ...
