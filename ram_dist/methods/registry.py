"""The method registry: names to configured method instances (as mergekit does)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ram_dist.errors import RamDistError


class MergeMethod(Protocol):
    """What the engine needs of a merge rule.

    `chunk_statistics` runs on workers in the reduce pass and returns an int64 tensor that the
    driver sums over chunks; `finalize` runs once on the driver and turns the sum into what
    the map pass needs; `merge_chunk` runs on workers in the map pass.
    """

    name: str

    def params(self, **values: Any) -> Any: ...

    def chunk_statistics(
        self, base: torch.Tensor, tasks: list[torch.Tensor], params: Any
    ) -> torch.Tensor: ...

    def finalize(self, total: torch.Tensor, params: Any) -> dict[str, Any]: ...

    def merge_chunk(
        self,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: Any,
        finalized: dict[str, Any],
    ) -> torch.Tensor: ...


METHODS: dict[str, MergeMethod] = {}


def register(method: MergeMethod) -> MergeMethod:
    if method.name in METHODS:
        raise ValueError(f"merge method {method.name!r} registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> MergeMethod:
    """The method called `name`, or an error that lists the valid names."""
    _load_builtin()
    try:
        return METHODS[name]
    except KeyError:
        raise RamDistError(
            f"unknown merge method {name!r}; valid methods: {', '.join(sorted(METHODS))}"
        ) from None


def _load_builtin() -> None:
    from ram_dist.methods import ram  # noqa: F401  (registers on import)
