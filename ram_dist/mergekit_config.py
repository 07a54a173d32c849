"""mergekit's YAML configuration, read into a frozen job description, and its parameter rules.

Runs on the driver, once, when a job starts: everything a user can get wrong in the file is
reported here, with the file's path, before any tensor is read. Pure Python and PyYAML; no
torch, no I/O except reading the YAML file.

What a mergekit configuration may say, for the methods ram-dist runs (`ram`, `ram_plus`,
`ram_plus_soft`, `ramplus_tl`, `task_arithmetic`, `ties`, `dare_linear`, `dare_ties`,
`linear`)::

    merge_method: ties
    base_model: path/or/url/of/base
    models:
      - model: path/of/task1
        parameters: {weight: 0.7, density: [0.2, 0.5, 0.9]}
      - model: path/of/task2
        parameters:
          weight: [{filter: mlp, value: 0.3}, {value: 0.5}]
    parameters: {normalize: true, lambda: 1.0}
    dtype: float32
    out_dtype: bfloat16
    tokenizer_source: base
    storage_options: {s3: {endpoint_url: ...}}   # ram-dist's own: fsspec options per protocol
    device: auto                                  # ram-dist's own: auto, cpu or cuda

A parameter's value is a scalar, a list of numbers interpolated across the layers (a
"gradient"), or a list of `{filter, value}` entries whose filters are matched as substrings of
the tensor name (a value may itself be a gradient). `resolve` and `resolve_parameter` follow
mergekit 0.1.5 (`mergekit.config.evaluate_setting`, `mergekit.parameter_resolver`,
`mergekit.plan.MergePlanner`) exactly:

* Filter lists: the FIRST entry in list order whose filter matches wins (not the longest);
  an entry matches when it has no filter, when its filter is `"*"`, or when its filter is a
  substring of the tensor name. When no entry matches, the setting gives nothing and the next
  scope is asked.
* Gradients: `t` is the tensor's position (see `position`); with `n` values,
  `s = t * (n - 1)`, `i0 = int(s)`, `i1 = min(n - 1, i0 + 1)`, `f = s - i0`, value
  `(1 - f) * v[i0] + f * v[i1]` (Python floats, so the same bits as mergekit). A list of
  booleans (or strings) is not interpolated: it picks `v[int(t * (n - 1))]`.
* Scopes: a per-model parameter (`weight`, `density`) is looked up in that model's own
  `parameters` first, then in the top-level `parameters`, then the method's default; the first
  scope that yields a value wins (a model's filter list without a matching entry falls through
  to the top-level one). Global parameters (`normalize`, `lambda`, `rescale`, `r`, `alpha`,
  `epsilon`) are read only from the top-level `parameters`: mergekit ignores them under a
  model, and so does ram-dist (with a note).
* Position `t`: tensors of decoder layer `i` of `n` (`model.layers.{i}.…`) have
  `t = i / (n - 1)` (`t = 1` when `n == 1`); every other tensor (embeddings, the final norm,
  `lm_head`, anything outside the layers) has `t = 0` — mergekit plans them with a reader at
  `t = 0`, the post-layer weights included, not at `t = 1`.

The output dtype is mergekit's: `out_dtype`, else `dtype` (what mergekit computed in and so
writes), else the CLI's default. ram-dist always computes in float32, with a note when `dtype`
says otherwise.

Anything mergekit accepts but ignores is accepted and ignored here too, with a note in
`JobSpec.notes` (e.g. `int8_mask`, which only changes the dtype of mergekit's sign mask). What
ram-dist cannot do (`slices`, `modules`, other tokenizer sources, ...) is a `RamDistError`
that names the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ram_dist.dtypes import OUT_DTYPE_NAMES, dtype_key
from ram_dist.engine.devices import DEVICES as _DEVICES
from ram_dist.errors import RamDistError

__all__ = [
    "METHOD_PARAMETERS",
    "REQUIRED",
    "FilterEntry",
    "Filtered",
    "Gradient",
    "JobSpec",
    "MethodParameters",
    "ModelSpec",
    "ParamMap",
    "ParamValue",
    "effective_config",
    "layer_index",
    "load_mergekit_yaml",
    "parse_mergekit_config",
    "parse_setting",
    "position",
    "resolve",
    "resolve_parameter",
]

Scalar = float | bool | str
"""One value: a float (`weight`, `lambda`, ...), a bool (`normalize`, ...) or a str (`scope`)."""


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
    device: str | None = None
    """auto, cpu or cuda (ram-dist's own key, as `--device`); None: not given."""
    notes: tuple[str, ...] = ()
    """What was accepted but changed or ignored, one sentence each."""
    where: str = field(default="", compare=False)
    """The configuration file, for error messages."""


@dataclass(frozen=True)
class MethodParameters:
    """The parameters one method reads, split as mergekit splits them."""

    shared: tuple[str, ...]
    """Read from the top-level `parameters` only."""
    per_model: tuple[str, ...]
    """Read from each model's `parameters`, then the top-level ones."""
    no_effect: tuple[str, ...] = ()
    """Declared by mergekit's method but without effect on the result: accepted, ignored."""


_GTA = MethodParameters(
    shared=("normalize", "lambda", "rescale"),
    per_model=("weight", "density"),
    no_effect=("int8_mask",),
)
_RAM = MethodParameters(shared=("r", "alpha", "epsilon", "scope"), per_model=())

#: Methods a configuration may name, and their parameters (mergekit 0.1.5's declarations:
#: `GeneralizedTaskArithmeticMerge.spec`, `linear_merge`; the RAM family is ram-dist's, whose
#: `r`, `alpha`, `epsilon` are mergekit's `ramplus_tl` names, plus ram-dist's `scope`).
METHOD_PARAMETERS: Mapping[str, MethodParameters] = {
    "task_arithmetic": MethodParameters(
        shared=("normalize", "lambda"),
        per_model=("weight",),
        no_effect=("int8_mask", "rescale", "density"),  # no sparsification in mergekit
    ),
    "ties": _GTA,
    "dare_linear": _GTA,
    "dare_ties": _GTA,
    "linear": MethodParameters(shared=("normalize",), per_model=("weight",)),
    "ram": _RAM,
    "ram_plus": _RAM,
    "ram_plus_soft": _RAM,
    "ramplus_tl": _RAM,
}

#: Methods without a base model (mergekit's contract `base=IGNORED`).
_BASELESS = frozenset({"linear"})

#: Every parameter name a configuration may use, and its value type.
_KINDS: Mapping[str, type] = {
    "weight": float,
    "density": float,
    "lambda": float,
    "r": float,
    "alpha": float,
    "epsilon": float,
    "normalize": bool,
    "rescale": bool,
    "int8_mask": bool,
    "scope": str,
}
_CHOICES: Mapping[str, tuple[str, ...]] = {"scope": ("model", "tensor")}

TOP_KEYS = (
    "merge_method",
    "base_model",
    "models",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "storage_options",
    "device",
)
#: Keys `effective_config` writes that carry no setting: read back and ignored.
_RECORD_KEYS = ("notes", "storage_protocols")
#: mergekit keys ram-dist does not implement, and why.
_UNSUPPORTED_KEYS: Mapping[str, str] = {
    "slices": "ram-dist merges whole models; give `models:` instead",
    "modules": "ram-dist merges whole models; give `models:` instead",
    "tokenizer": "ram-dist keeps the base model's tokenizer (tokenizer_source: base)",
    "chat_template": "ram-dist keeps the base model's chat template",
    "merge_method_sequence": "ram-dist runs one merge method per job",
}
_MODEL_KEYS = ("model", "parameters")
_ENTRY_KEYS = ("filter", "value")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class _Required:
    """The type of `REQUIRED`."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: `resolve_parameter`'s default for a parameter that must be set (mergekit's `weight`).
REQUIRED: Any = _Required()

_LAYER = re.compile(r"^(?:model\.layers|transformer\.h|gpt_neox\.layers|backbone\.layers)\.(\d+)\.")


# ---------------------------------------------------------------------------------------------
# Resolution


def layer_index(tensor_name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for a tensor outside the layers.

    mergekit takes the layer from its architecture definition (`layer_templates`), whose
    templates are `model.layers.${layer_index}.…` for Llama, Qwen2, Mistral, Gemma and most
    decoder-only models (other decoder layouts: `transformer.h.`, `gpt_neox.layers.`,
    `backbone.layers.`); `model.embed_tokens.weight` is a pre-layer weight, `model.norm.weight`
    and `lm_head.weight` post-layer weights, outside the layers. Names of other layouts
    (encoders, vision towers, multi-module models) are not layers here.
    """
    match = _LAYER.match(tensor_name)
    return int(match.group(1)) if match else None


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
    the scopes of no model). A scope whose setting gives nothing for this tensor (a filter list
    without a matching entry) passes to the next; when none gives a value, `default` is
    returned, or, when it is `REQUIRED`, a `RamDistError` naming the model and tensor.
    """
    scopes: list[ParamMap] = []
    if model_index is not None:
        if not 0 <= model_index < len(spec.models):
            raise IndexError(f"model_index {model_index} out of range ({len(spec.models)})")
        scopes.append(spec.models[model_index].parameters)
    scopes.append(spec.parameters)
    for scope in scopes:
        if name in scope:
            value = resolve(scope[name], tensor_name, num_layers)
            if value is not None:
                return value
    if default is REQUIRED:
        owner = "" if model_index is None else f"{spec.models[model_index].model} "
        raise RamDistError(
            f"config {spec.where}: no {name} for {owner}tensor {tensor_name}: no filter "
            f"matches it and there is no default; add an entry without a filter"
        )
    return default


# ---------------------------------------------------------------------------------------------
# Reading


def load_mergekit_yaml(path: str) -> JobSpec:
    """Read and check a mergekit YAML file (see `parse_mergekit_config`)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise RamDistError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        raise RamDistError(f"config {path} is not valid YAML: {e}") from e
    return parse_mergekit_config(raw, path)


def parse_mergekit_config(raw: Any, where: str) -> JobSpec:
    """Check a loaded mergekit configuration and turn it into a `JobSpec`.

    `where` (the file's path) prefixes every error. Raises `RamDistError` on a key or value
    ram-dist cannot honour; never asserts.
    """
    p = f"config {where}"
    if not isinstance(raw, dict):
        raise RamDistError(f"{p}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    for key in raw:
        if key in _UNSUPPORTED_KEYS:
            raise RamDistError(f"{p}: {key!r} is not supported: {_UNSUPPORTED_KEYS[key]}")
        if key not in TOP_KEYS and key not in _RECORD_KEYS:
            raise RamDistError(f"{p}: unknown key {key!r}; valid keys: {', '.join(TOP_KEYS)}")
    notes: list[str] = []

    method = raw.get("merge_method")
    if not isinstance(method, str):
        raise RamDistError(f"{p}: merge_method is required (one of {_method_list()})")
    if method not in METHOD_PARAMETERS:
        raise RamDistError(
            f"{p}: merge_method {method!r} is not supported; use one of {_method_list()}"
        )
    table = METHOD_PARAMETERS[method]

    base = raw.get("base_model")
    if base is not None:
        base = _model_name(base, f"{p}: base_model")
    elif method not in _BASELESS:
        raise RamDistError(f"{p}: {method} needs a base_model (the checkpoint tasks start from)")

    parameters = _parameters(
        raw.get("parameters"), table, method, p, "parameters", notes, per_model=False
    )
    models = _models(raw.get("models"), base, table, method, p, notes)

    dtype = _dtype(raw.get("dtype"), f"{p}: dtype")
    out_dtype = _dtype(raw.get("out_dtype"), f"{p}: out_dtype")
    if out_dtype is None and dtype is not None:
        # mergekit's rule: without out_dtype, tensors are written in the dtype they were
        # computed in, `dtype` (and config.json says so).
        out_dtype = dtype
    if dtype is not None and OUT_DTYPE_NAMES[dtype_key(dtype)] != "F32":
        written = f"{out_dtype}, as mergekit writes it" if out_dtype == dtype else out_dtype
        notes.append(
            f"dtype {dtype} accepted, but ram-dist computes in float32 (mergekit would compute "
            f"in {dtype}) and writes {written}; the result is mergekit's with dtype: float32 "
            f"and out_dtype: {out_dtype}"
        )

    tokenizer_source = raw.get("tokenizer_source")
    if tokenizer_source is not None and tokenizer_source != "base":
        raise RamDistError(
            f"{p}: tokenizer_source {tokenizer_source!r} is not supported; ram-dist keeps the "
            "base model's tokenizer (write tokenizer_source: base, or leave it out)"
        )

    storage = raw.get("storage_options")
    if storage is None:
        storage = {}
    if not isinstance(storage, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in storage.items()
    ):
        raise RamDistError(
            f"{p}: storage_options must map a protocol to its fsspec options, "
            "e.g. {s3: {endpoint_url: ...}}"
        )
    device = raw.get("device")
    if device is not None and device not in _DEVICES:
        raise RamDistError(f"{p}: device {device!r} is not one of {', '.join(_DEVICES)}")
    record = raw.get("notes")
    if record is not None and not isinstance(record, list):
        raise RamDistError(f"{p}: notes (written by ram-dist) must be a list")

    return JobSpec(
        merge_method=method,
        base_model=base,
        models=models,
        parameters=parameters,
        dtype=dtype,
        out_dtype=out_dtype,
        tokenizer_source=tokenizer_source,
        storage_options=storage,
        device=device,
        notes=tuple(notes),
        where=where,
    )


def parse_setting(raw: Any, name: str, where: str = "") -> ParamValue:
    """One raw YAML setting of parameter `name` as a checked `ParamValue`.

    Converted as in a configuration file (numbers to float, `1e-5` strings included); raises
    `RamDistError` naming `where` and `name` on a bad value or an unknown parameter name.
    """
    prefix = f"config {where}" if where else "parameter"
    if name not in _KINDS:
        raise RamDistError(f"{prefix}: unknown parameter {name!r}; valid: {', '.join(_KINDS)}")
    return _setting(raw, name, prefix, name, [])


def _method_list() -> str:
    return ", ".join(METHOD_PARAMETERS)


def _model_name(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RamDistError(f"{at} must be a folder, URL or Hugging Face id (a string)")
    if "+" in value:
        raise RamDistError(
            f"{at}: {value!r} is a model+LoRA reference (mergekit's '+'), which ram-dist does "
            "not support; merge the adapter into the model first"
        )
    return value


def _models(
    raw: Any,
    base: str | None,
    table: MethodParameters,
    method: str,
    p: str,
    notes: list[str],
) -> tuple[ModelSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise RamDistError(f"{p}: models must be a non-empty list of {{model: PATH}}")
    seen: dict[str, int] = {}
    models: list[ModelSpec] = []
    base_listed = False
    for i, entry in enumerate(raw):
        at = f"models[{i}]"
        if not isinstance(entry, dict):
            raise RamDistError(f"{p}: {at} must be a mapping like {{model: PATH, parameters: ...}}")
        unknown = sorted(set(entry) - set(_MODEL_KEYS), key=str)
        if unknown:
            raise RamDistError(
                f"{p}: {at}: unknown key {unknown[0]!r}; valid keys: {', '.join(_MODEL_KEYS)}"
            )
        if "model" not in entry:
            raise RamDistError(f"{p}: {at} needs a model: PATH")
        name = _model_name(entry["model"], f"{p}: {at}.model")
        if name in seen:
            raise RamDistError(f"{p}: {at}: {name} is listed twice (also models[{seen[name]}])")
        seen[name] = i
        params = _parameters(
            entry.get("parameters"), table, method, p, f"{at}.parameters", notes, per_model=True
        )
        if name == base:
            base_listed = True
            if method not in _BASELESS:
                if params:
                    notes.append(
                        f"{at} is the base_model: its parameters ({', '.join(params)}) are "
                        f"ignored, as mergekit ignores them for the base in {method}"
                    )
                continue
        models.append(ModelSpec(model=name, parameters=params))
    if method in _BASELESS and base is not None and not base_listed:
        models.append(ModelSpec(model=base))
        notes.append(
            f"{method}: base_model {base} is averaged as one more input (appended after the "
            "listed models, with the top-level parameters), as mergekit does; list it under "
            "models to give it its own weight, or leave base_model out"
        )
    if not models:
        raise RamDistError(f"{p}: models lists no model besides base_model; nothing to merge")
    return tuple(models)


def _parameters(
    raw: Any,
    table: MethodParameters,
    method: str,
    p: str,
    at: str,
    notes: list[str],
    *,
    per_model: bool,
) -> ParamMap:
    """`p` prefixes errors ("config FILE"); `at` is the place in the file ("parameters")."""
    if raw is None:
        return ParamMap()
    if not isinstance(raw, dict):
        raise RamDistError(f"{p}: {at} must be a mapping of parameter names to values")
    known = table.shared + table.per_model + table.no_effect
    values: dict[str, ParamValue] = {}
    for name, setting in raw.items():
        if name not in _KINDS:
            valid = table.per_model if per_model else known
            raise RamDistError(
                f"{p}: {at}: unknown parameter {name!r}; valid for {method}"
                f"{' per model' if per_model else ''}: {', '.join(valid) or '(none)'}"
            )
        value = _setting(setting, name, p, f"{at}.{name}", notes)
        if name in table.no_effect:
            notes.append(f"{at}.{name} accepted and ignored: it has no effect in {method}")
        elif name not in known:
            notes.append(
                f"{at}.{name} ignored: {method} has no parameter {name} (mergekit ignores it)"
            )
        elif per_model and name not in table.per_model:
            notes.append(
                f"{at}.{name} ignored: {name} is a global parameter, read only from the "
                "top-level parameters (mergekit ignores it under a model)"
            )
        else:
            values[name] = value
    return ParamMap.of(values)


def _setting(raw: Any, name: str, p: str, at: str, notes: list[str]) -> ParamValue:
    if isinstance(raw, dict):
        return Filtered((_entry(raw, name, p, at),))
    if isinstance(raw, list):
        if not raw:
            raise RamDistError(f"{p}: {at} is an empty list; give a value, values or filters")
        if all(isinstance(e, dict) for e in raw):
            entries = tuple(_entry(e, name, p, f"{at}[{i}]") for i, e in enumerate(raw))
            catch_all = next(
                (i for i, e in enumerate(entries) if e.filter in (None, "*", "")), None
            )
            if catch_all is not None and catch_all < len(entries) - 1:
                notes.append(
                    f"{at}: entries after [{catch_all}], which matches every tensor, never "
                    "apply (the first matching entry wins)"
                )
            return Filtered(entries)
        return _gradient(raw, name, p, at)
    return _leaf(raw, name, p, at)


def _entry(raw: dict[Any, Any], name: str, p: str, at: str) -> FilterEntry:
    unknown = sorted(set(raw) - set(_ENTRY_KEYS), key=str)
    if unknown:
        raise RamDistError(
            f"{p}: {at}: unknown key {unknown[0]!r} in a filter entry; valid keys: filter, value"
        )
    if "value" not in raw:
        raise RamDistError(f"{p}: {at}: a filter entry needs a value")
    filter_ = raw.get("filter")
    if filter_ is not None and not isinstance(filter_, str):
        raise RamDistError(f"{p}: {at}.filter must be a string (part of a tensor name)")
    value = raw["value"]
    if isinstance(value, dict):
        raise RamDistError(f"{p}: {at}.value: filter entries cannot nest")
    if isinstance(value, list):
        return FilterEntry(filter=filter_, value=_gradient(value, name, p, f"{at}.value"))
    return FilterEntry(filter=filter_, value=_leaf(value, name, p, f"{at}.value"))


def _gradient(raw: list[Any], name: str, p: str, at: str) -> Gradient:
    if not raw:
        raise RamDistError(f"{p}: {at} is an empty list")
    if any(isinstance(e, (dict, list)) for e in raw):
        raise RamDistError(
            f"{p}: {at}: a list holds either values across layers or {{filter, value}} "
            "entries; filter entries cannot nest, and the two cannot mix"
        )
    return Gradient(tuple(_leaf(e, name, p, f"{at}[{i}]") for i, e in enumerate(raw)))


def _leaf(raw: Any, name: str, p: str, at: str) -> Scalar:
    """One value of parameter `name`, converted as mergekit's pydantic types convert it."""
    kind = _KINDS[name]
    if kind is float:
        value: float | None = None
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            value = _finite(raw)
        elif isinstance(raw, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                value = _finite(float(raw.strip()))
            except ValueError:
                value = None
        if value is None:
            raise RamDistError(f"{p}: {at} must be a finite number, got {raw!r}")
        return value
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, (int, float)) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise RamDistError(f"{p}: {at} must be true or false, got {raw!r}")
    choices = _CHOICES[name]
    if raw not in choices:
        raise RamDistError(f"{p}: {at} must be one of {', '.join(choices)}, got {raw!r}")
    return str(raw)


def _finite(value: float | int) -> float | None:
    try:
        result = float(value)
    except OverflowError:
        return None
    return result if math.isfinite(result) else None


def _dtype(raw: Any, at: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or dtype_key(raw) not in OUT_DTYPE_NAMES:
        valid = ", ".join(sorted(OUT_DTYPE_NAMES))
        raise RamDistError(f"{at} {raw!r} is not a floating dtype; use one of: {valid}")
    return raw


# ---------------------------------------------------------------------------------------------
# Writing


def effective_config(spec: JobSpec) -> dict[str, Any]:
    """What ram-dist ran, as plain data for `yaml.safe_dump`, loadable again.

    The models and parameters it used (ignored ones dropped), `dtype: float32` (the math it
    did), and the notes. Storage options may hold secrets: only their protocols are listed
    (`storage_protocols`), never their values. `notes` and `storage_protocols` are read back
    and ignored.
    """
    out: dict[str, Any] = {"merge_method": spec.merge_method}
    if spec.base_model is not None:
        out["base_model"] = spec.base_model
    models = []
    for m in spec.models:
        entry: dict[str, Any] = {"model": m.model}
        if m.parameters:
            entry["parameters"] = {k: _dump(v) for k, v in m.parameters.items()}
        models.append(entry)
    out["models"] = models
    if spec.parameters:
        out["parameters"] = {k: _dump(v) for k, v in spec.parameters.items()}
    out["dtype"] = "float32"
    if spec.out_dtype is not None:
        out["out_dtype"] = spec.out_dtype
    if spec.tokenizer_source is not None:
        out["tokenizer_source"] = spec.tokenizer_source
    if spec.storage_options:
        out["storage_protocols"] = sorted(spec.storage_options)
    if spec.device is not None:
        out["device"] = spec.device
    if spec.notes:
        out["notes"] = list(spec.notes)
    return out


def _dump(value: ParamValue | Scalar) -> Any:
    if isinstance(value, Filtered):
        return [
            {"value": _dump(e.value)}
            if e.filter is None
            else {"filter": e.filter, "value": _dump(e.value)}
            for e in value.entries
        ]
    if isinstance(value, Gradient):
        return list(value.values)
    return value
