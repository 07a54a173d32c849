"""What a mergekit configuration says, as frozen, hashable, picklable values.

`reading` builds them from YAML, `resolving` turns them into each tensor's values.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

#: What the package exports of this module (`ram_dist.mergekit_config`).
__all__ = [
    "FilterEntry",
    "Filtered",
    "Gradient",
    "JobSpec",
    "ModelSpec",
    "ParamMap",
    "ParamValue",
    "Scalar",
]

Scalar = float | bool | int | str
"""One value: a float (`weight`, `lambda`, ...), a bool (`normalize`, ...), an int (`seed`) or a
str (`scope`)."""


@dataclass(frozen=True)
class Gradient:
    """A list of values interpolated across the layers (mergekit's "gradient")."""

    values: tuple[Scalar, ...]
    """At least one value, all of the parameter's type."""


@dataclass(frozen=True)
class FilterEntry:
    """One `{filter, value}` entry of a filter list."""

    filter: str | None
    """Matched as a substring of the tensor name; None (no filter) and "*" match every tensor."""
    value: Scalar | Gradient
    """The setting for tensors this entry matches."""


@dataclass(frozen=True)
class Filtered:
    """A list of `{filter, value}` entries; the first one that matches a tensor applies."""

    entries: tuple[FilterEntry, ...]


ParamValue = float | bool | str | Gradient | Filtered
"""A parameter's setting as written: a scalar, a gradient, or a filter list (all hashable)."""


@dataclass(frozen=True)
class ParamMap(Mapping[str, ParamValue]):
    """A read-only, hashable, picklable mapping of parameter names to settings (sorted)."""

    items_: tuple[tuple[str, ParamValue], ...] = ()
    """(name, setting) pairs, sorted by name, names unique."""

    @classmethod
    def of(cls, values: Mapping[str, ParamValue]) -> ParamMap:
        return cls(tuple(sorted(values.items())))

    def __getitem__(self, key: str) -> ParamValue:
        for name, value in self.items_:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)


@dataclass(frozen=True)
class ModelSpec:
    """One input model and its own parameters (mergekit's `models: - model: ...`)."""

    model: str
    """Folder, URL or Hugging Face id, as written."""
    parameters: ParamMap = field(default_factory=ParamMap)
    """Per-model settings (`weight`, `density`); they win over the top-level ones."""


@dataclass(frozen=True)
class JobSpec:
    """A checked mergekit configuration: what to merge, and how.

    `models` are the inputs that carry weights, in mergekit's order. For the methods that need
    a base (every one but `linear`), an entry naming `base_model` is the base, not a task: it is
    left out of `models`; mergekit never reads the base's `weight`/`density` for these methods,
    so parameters written on that entry are ignored (with a note). For `linear`, which has no
    base, mergekit averages `base_model` as one more input: an entry naming it stays in
    `models` with its parameters, and a `base_model` not listed is appended last, with only the
    top-level parameters (mergekit does the same; it is noted).
    """

    merge_method: str
    """The method's name as written (mergekit's or ram-dist's); the caller maps it."""
    base_model: str | None
    """The base checkpoint; None only for `linear`."""
    models: tuple[ModelSpec, ...]
    """The weighted inputs (see the class docstring), in order; the order is part of the
    result."""
    parameters: ParamMap
    """Top-level settings: the method's global parameters and defaults for per-model ones."""
    dtype: str | None = None
    """mergekit's compute dtype as written; ram-dist always computes in float32."""
    out_dtype: str | None = None
    """Output dtype name as written (None keeps each tensor's dtype)."""
    tokenizer_source: str | None = None
    """None or "base": the base model's tokenizer."""
    storage_options: Mapping[str, Mapping[str, Any]] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )
    """fsspec options per protocol (ram-dist's own key); may hold secrets, never printed."""
    sweep: Mapping[str, Any] | None = None
    """ram-dist's `sweep:` (`methods`, `grid`), as read; None: one merge."""
    device: str | None = None
    """auto, cpu or cuda (ram-dist's own key, as `--device`); None: not given."""
    notes: tuple[str, ...] = ()
    """What was accepted but changed or ignored, one sentence each."""
    where: str = field(default="", compare=False)
    """The configuration file, for error messages."""
