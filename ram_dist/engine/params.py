"""Parameters resolved per tensor, on the driver, before any work starts.

A parameter may be a number, a list interpolated across layers, or `{filter, value}` entries
matched against tensor names (mergekit's forms); each tensor gets plain values, per-task
parameters as lists in task order. Every value is checked here, so a bad density fails the
job before a byte is read, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ram_dist.config import MergeConfig
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config import layer_index, resolve
from ram_dist.methods import MergeMethod

#: Accepted for mergekit compatibility and ignored (the math is float32 throughout).
IGNORED = ("int8_mask",)


def num_layers(names: list[str]) -> int:
    """How many transformer layers the tensor names show (mergekit's layer templates)."""
    found = [i for n in names if (i := layer_index(n)) is not None]
    return max(found) + 1 if found else 1


def check_names(config: MergeConfig, method: MergeMethod) -> None:
    """Unknown parameter names are an error that lists the valid ones."""
    valid_global = {*method.global_parameters, *method.task_parameters, *IGNORED}
    for key in config.parameters:
        if key not in valid_global:
            raise RamDistError(
                f"method {method.name} has no parameter {key!r}; valid: "
                + ", ".join(sorted(valid_global - set(IGNORED)))
            )
    for i, params in enumerate(config.task_parameters):
        for key in params:
            if key not in method.task_parameters and key not in IGNORED:
                valid = ", ".join(sorted(method.task_parameters)) or "none"
                raise RamDistError(
                    f"task {i + 1}: method {method.name} has no per-model parameter {key!r}; "
                    f"valid: {valid}"
                )


def resolve_all(
    config: MergeConfig, method: MergeMethod, tensors: list[str]
) -> dict[str, dict[str, Any]]:
    """Per participating tensor: every parameter of `method` as a plain value, checked.

    mergekit's precedence: a per-task parameter comes from the task's own settings, then the
    global ones, then the method's default; a setting that gives nothing for this tensor (a
    filter list without a matching entry) passes to the next. Global parameters come from the
    global settings only.
    """
    check_names(config, method)
    layers = num_layers(tensors)
    per_task = list(config.task_parameters) or [{} for _ in config.tasks]
    out = {}
    for name in tensors:
        params: dict[str, Any] = {}
        for key, default in method.global_parameters.items():
            params[key] = _first([config.parameters], key, name, layers, default)
        for key, default in method.task_parameters.items():
            params[key] = [
                _first([task, config.parameters], key, name, layers, default) for task in per_task
            ]
        method.check(params, f"tensor {name!r}")
        out[name] = params
    return out


def _first(
    scopes: list[Mapping[str, Any]], key: str, tensor: str, layers: int, default: Any
) -> Any:
    for scope in scopes:
        if key in scope:
            value = resolve(scope[key], tensor, layers)
            if value is not None:
                return value
    return default
