"""Each tensor's parameter values from a configuration's settings, as mergekit 0.1.5 gives them.

One precedence rule (`_scopes`, `first_value`) serves both `resolve_parameter` (one parameter
of a `JobSpec`) and `resolve_tensor` (every parameter of a method for one tensor, which the
engine runs for every tensor before any work starts). The rules are mergekit's
(`mergekit.config.evaluate_setting`, `mergekit.parameter_resolver`,
`mergekit.plan.MergePlanner`):

* Filter lists: the FIRST entry in list order whose filter matches wins (not the longest);
  an entry matches when it has no filter, when its filter is `"*"`, or when its filter is a
  substring of the tensor name. When no entry matches, the setting gives nothing and the next
  scope is asked.
* Gradients: `t` is the tensor's position (see `position`); with `n` values,
  `s = t * (n - 1)`, `i0 = int(s)`, `i1 = min(n - 1, i0 + 1)`, `f = s - i0`, value
  `(1 - f) * v[i0] + f * v[i1]` (Python floats, so the same bits as mergekit). A list of
  booleans, integers or strings is not interpolated: it picks `v[int(t * (n - 1))]`.
* Scopes: a per-task parameter (`weight`, `density`) is looked up in that task's own settings
  first, then in the top-level ones, then it takes the method's default; the first scope
  that yields a value wins (a task's filter list without a matching entry falls through to
  the top-level one). A global parameter (`normalize`, `lambda`, `r`, ...) is read only from
  the top-level settings.
* Position `t`: tensors of decoder layer `i` of `n` (`methods.decoder_layers`) have
  `t = i / (n - 1)` (`t = 1` when `n == 1`); every other tensor (embeddings, the final norm,
  `lm_head`, anything outside the layers) has `t = 0`: mergekit plans them with a reader at
  `t = 0`, the post-layer weights included, not at `t = 1`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ram_dist.errors import RamDistError
from ram_dist.mergekit_config.spec import Filtered, Gradient, JobSpec, ParamValue, Scalar
from ram_dist.methods.decoder_layers import layer_index
from ram_dist.methods.parameters import Parameter

Settings = Mapping[str, Any]
"""One scope's settings by parameter name: `ParamValue`s, or plain values."""


class _Required:
    """The type of `REQUIRED`."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: `resolve_parameter`'s default for a parameter that must be set (mergekit's `weight`).
REQUIRED: Any = _Required()


def num_layers(tensor_names: Sequence[str]) -> int:
    """How many decoder layers the tensor names show (1 when none)."""
    found = [i for n in tensor_names if (i := layer_index(n)) is not None]
    return max(found) + 1 if found else 1


def position(tensor_name: str, num_layers: int) -> float:
    """mergekit's interpolation position `t` of a tensor in a model of `num_layers` layers.

    Layer `i`: `i / (num_layers - 1)`, or 1 when there is a single layer
    (`MergePlanner.plan_slice`). Any other tensor: 0 (`MergePlanner.plan_module` plans the
    pre- and post-layer weights with a `ConfigReader` at `t=0`).
    """
    index = layer_index(tensor_name)
    if index is None:
        return 0.0
    if not 0 <= index < num_layers:
        raise RamDistError(
            f"tensor {tensor_name} is in layer {index}, but the model has {num_layers} layers "
            "(num_hidden_layers in its config.json); the checkpoint and its config disagree"
        )
    return index / (num_layers - 1) if num_layers > 1 else 1.0


def resolve(value: ParamValue, tensor_name: str, num_layers: int) -> Scalar | None:
    """The value a setting gives one tensor, or None when a filter list has no matching entry.

    mergekit's `evaluate_setting`: see the module docstring for the rules. `value` is a parsed
    setting (from a `JobSpec`, or `parse_setting` for a raw YAML value).
    """
    if isinstance(value, (list, tuple, dict)):
        raise TypeError(
            "resolve takes a parsed setting (Gradient, Filtered or a scalar), not a raw YAML "
            f"{type(value).__name__}; convert it with parse_setting(raw, name) first"
        )
    return _evaluate(value, tensor_name, position(tensor_name, num_layers))


def _evaluate(value: ParamValue, tensor_name: str, t: float) -> Scalar | None:
    if isinstance(value, Filtered):
        for entry in value.entries:
            if (
                entry.filter is None
                or entry.filter == "*"
                or (tensor_name and entry.filter in tensor_name)
            ):
                return _evaluate(entry.value, tensor_name, t)
        return None
    if isinstance(value, Gradient):
        values = value.values
        if not all(isinstance(v, float) for v in values):  # bools/strings: pick, never mix
            return values[int(t * (len(values) - 1))]
        scaled = t * (len(values) - 1)
        i0 = int(scaled)
        i1 = min(len(values) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * values[i0] + frac * values[i1]
    return value


def _scopes(top: Settings, own: Settings | None) -> list[Settings]:
    """Where a parameter is looked up, first to last: a task's own settings (for a per-task
    parameter), then the top-level ones."""
    return [top] if own is None else [own, top]


def first_value(
    scopes: Sequence[Settings], name: str, tensor_name: str, num_layers: int, default: Any
) -> Any:
    """The value of the first scope whose setting of `name` gives this tensor one (a filter
    list without a matching entry gives none); `default` when none does."""
    for scope in scopes:
        if name in scope:
            value = resolve(scope[name], tensor_name, num_layers)
            if value is not None:
                return value
    return default


def resolve_tensor(
    parameters: Sequence[Parameter],
    top: Settings,
    per_task: Sequence[Settings],
    tensor_name: str,
    num_layers: int,
) -> dict[str, Any]:
    """Every parameter's value for one tensor, in the order of `parameters`: per-task ones as
    lists in task order (`per_task` holds each task's own settings), global ones as values."""
    values: dict[str, Any] = {}
    for p in parameters:
        owners = per_task if p.per_task else [None]
        found = [
            first_value(_scopes(top, own), p.name, tensor_name, num_layers, p.default)
            for own in owners
        ]
        values[p.name] = found if p.per_task else found[0]
    return values


def resolve_parameter(
    spec: JobSpec,
    name: str,
    model_index: int | None,
    tensor_name: str,
    num_layers: int,
    default: Any,
) -> Any:
    """One parameter's value for one tensor, with mergekit's precedence.

    `model_index` indexes `spec.models` for a per-model parameter (`weight`, `density`): that
    model's own setting first, then the top-level one. None for a global parameter: the
    top-level setting only (mergekit's `resolve_parameters` resolves shared parameters from
    the scopes of no model). When no scope gives a value, `default` is returned, or, when it
    is `REQUIRED`, a `RamDistError` naming the model and tensor.
    """
    own = None
    if model_index is not None:
        if not 0 <= model_index < len(spec.models):
            raise IndexError(f"model_index {model_index} out of range ({len(spec.models)})")
        own = spec.models[model_index].parameters
    scopes = _scopes(spec.parameters, own)
    value = first_value(scopes, name, tensor_name, num_layers, REQUIRED)
    if value is not REQUIRED:
        return value
    if default is REQUIRED:
        owner = "" if model_index is None else f"{spec.models[model_index].model} "
        raise RamDistError(
            f"config {spec.where}: no {name} for {owner}tensor {tensor_name}: no filter "
            f"matches it and there is no default; add an entry without a filter"
        )
    return default
