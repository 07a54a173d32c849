"""The merge job: the settings declared in `ram_dist.settings`, checked, from the command
line, the API's keywords or a mergekit-style YAML file (`build`).

Everything is checked here, when the job starts, never in the middle of a merge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ram_dist.dtypes import parse_out_dtype
from ram_dist.errors import RamDistError
from ram_dist.io.storage import Storage
from ram_dist.methods import MergeMethod, get_method
from ram_dist.settings import (
    BY_NAME,
    YAML_KEYS,
    HowToRun,
    SweepOver,
    WhatToMerge,
    check_choices,
    parse_grid,
)


@dataclass(frozen=True, kw_only=True)
class MergeConfig(SweepOver, HowToRun, WhatToMerge):
    """One merge (or probe) job: what to merge and how to run it (`ram_dist.settings`, where
    each setting is declared), checked."""

    notes: tuple[str, ...] = ()
    """What the config asked for that was accepted but ignored or changed."""

    @property
    def sweeps(self) -> bool:
        """Whether it asks for a sweep (several methods, or a grid): `planning.sweep`."""
        return bool(self.grid) or len(self.methods) > 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "grid", parse_grid(self.grid))
        if self.methods:  # a sweep's methods: the first is the job's method
            object.__setattr__(self, "method", self.methods[0])
        for name in self.methods or (self.method,):  # each refused by name, before any work
            check_task_count(get_method(name), len(self.tasks))
        object.__setattr__(self, "out_dtype", parse_out_dtype(self.out_dtype))
        if self.task_parameters and len(self.task_parameters) != len(self.tasks):
            raise RamDistError(
                f"{len(self.task_parameters)} sets of per-task parameters for "
                f"{len(self.tasks)} tasks"
            )
        object.__setattr__(self, "task_parameters", tuple(self.task_parameters))
        check_choices({name: getattr(self, name) for name in BY_NAME})
        if self.cache_dir is not None:
            if "://" in self.cache_dir:
                raise RamDistError(f"cache dir must be a local folder, got {self.cache_dir!r}")
            # absolute here: the workers' current folder is not the driver's
            absolute = os.path.abspath(os.path.expanduser(self.cache_dir))
            object.__setattr__(self, "cache_dir", absolute)
        if self.unit_budget_bytes is not None and self.unit_budget_bytes <= 0:
            raise RamDistError(f"unit budget must be positive, got {self.unit_budget_bytes} bytes")
        if self.workers is not None and self.workers < 1:
            raise RamDistError(f"workers must be >= 1, got {self.workers}")
        Storage(self.storage_options)  # raises on a malformed mapping


def build(file: Mapping[str, Any], given: Mapping[str, Any]) -> MergeConfig:
    """The job: a config file's settings (`load_yaml`), then every setting `given` (not None)
    over them, as the flags and the API's keywords go over the file. Parameters go over the
    file's key by key; per-task ones task by task where both give every task's."""
    kwargs = dict(file)
    for name, value in given.items():
        if value is None:
            continue
        if name == "parameters":
            value = {**kwargs.get(name, {}), **value}
        elif name == "task_parameters":
            from_file = kwargs.get(name) or ()
            if len(from_file) == len(value):
                value = tuple({**f, **g} for f, g in zip(from_file, value, strict=True))
        kwargs[name] = value
    if "base" not in kwargs:
        raise RamDistError("give a base checkpoint: --base PATH (or base_model in a config)")
    kwargs.setdefault("tasks", ())
    return MergeConfig(**kwargs)


def load_yaml(source: str | Mapping[str, Any]) -> dict[str, Any]:
    """Read a mergekit configuration, a YAML file's path or the same keys as a mapping, into
    `MergeConfig` keyword arguments.

    The reader keeps only the parameters the method takes (it noted and dropped the others).
    """
    from ram_dist.mergekit_config import load_mergekit_yaml, parse_mergekit_config

    if isinstance(source, Mapping):
        spec = parse_mergekit_config(dict(source), "(a mapping)")
    else:
        spec = load_mergekit_yaml(source)
    models = list(spec.models)
    base = spec.base_model if spec.base_model is not None else models[0].model
    kwargs: dict[str, Any] = {
        "base": base,
        "tasks": tuple(m.model for m in models),
        "method": spec.merge_method,
        "parameters": dict(spec.parameters),
        "task_parameters": tuple(dict(m.parameters) for m in models),
        "notes": spec.notes,
    }
    if spec.sweep is not None:  # ram-dist's `sweep:` key (docs/sweeps.md)
        kwargs["methods"] = spec.sweep["methods"]
        kwargs["grid"] = spec.sweep["grid"]
    for key, name in YAML_KEYS.items():  # the settings a config may set too
        value = getattr(spec, key)
        if isinstance(value, Mapping):
            value = {k: dict(v) for k, v in value.items()} or None
        if value is not None:
            kwargs[name] = value
    return kwargs


def check_task_count(method: MergeMethod, given: int) -> None:
    """Refuse a number of task models `method` does not merge (`MergeMethod.task_counts`)."""
    least, most = method.task_counts
    if least <= given and (most is None or given <= most):
        return
    if most is None:
        wanted = f"{_count(least)} or more task models"
    elif least == most:
        wanted = f"exactly {_count(least)} task model{'s' if least > 1 else ''}"
    else:
        wanted = f"{_count(least)} to {_count(most)} task models"
    into = " with the base" if method.needs_base else ""
    raise RamDistError(
        f"{method.name} merges {wanted}{into}; got {given} (give --task once per model)"
    )


def _count(n: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(n, str(n))
