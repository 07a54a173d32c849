"""A mergekit YAML configuration, read and checked into a `JobSpec`.

Runs on the driver, once, when a job starts: everything a user can get wrong in the file is
reported here, with the file's path and the key, before any tensor is read. Which parameters
a method takes, and how each value is read, is `methods.parameters.PARAMETERS`.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from ram_dist.dtypes import OUT_DTYPE_NAMES, dtype_key
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config.spec import (
    Filtered,
    FilterEntry,
    Gradient,
    JobSpec,
    ModelSpec,
    ParamMap,
    ParamValue,
    Scalar,
)
from ram_dist.methods import get_method
from ram_dist.methods import parameters as method_parameters
from ram_dist.methods.parameters import Parameter
from ram_dist.settings import DEVICES as _DEVICES
from ram_dist.settings import YAML_KEYS

#: mergekit's keys, then the job settings a config may set too (`settings.YAML_KEYS`).
TOP_KEYS = (
    "merge_method",
    "base_model",
    "models",
    "parameters",
    "dtype",
    "tokenizer_source",
    *YAML_KEYS,
    "sweep",
)
#: The keys of ram-dist's `sweep:` (`docs/sweeps.md`): methods beside `merge_method`, and the
#: grid of parameter values.
SWEEP_KEYS = ("methods", "grid")
#: mergekit keys ram-dist does not implement, and why.
_UNSUPPORTED_KEYS = {
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
        if key not in TOP_KEYS:
            raise RamDistError(f"{p}: unknown key {key!r}; valid keys: {', '.join(TOP_KEYS)}")
    notes: list[str] = []

    method = raw.get("merge_method")
    if not isinstance(method, str):
        raise RamDistError(f"{p}: merge_method is required (one of {_method_list()})")
    if method not in method_parameters.PARAMETERS:
        raise RamDistError(
            f"{p}: merge_method {method!r} is not supported; use one of {_method_list()}"
        )
    table = method_parameters.PARAMETERS[method]

    base = raw.get("base_model")
    if base is not None:
        base = _model_name(base, f"{p}: base_model")
    elif get_method(method).needs_base:
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

    sweep = _sweep(raw.get("sweep"), method, p)
    return JobSpec(
        sweep=sweep,
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


def _sweep(raw: Any, method: str, p: str) -> dict[str, Any] | None:
    """ram-dist's `sweep:` key: `methods` (a list; `merge_method` alone when left out) and
    `grid` (each parameter's values), as `--method` and `--grid` give them."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RamDistError(f"{p}: sweep must be a mapping with keys {', '.join(SWEEP_KEYS)}")
    _refuse_unknown_keys(raw, SWEEP_KEYS, f"{p}: sweep")
    methods = raw.get("methods", [method])
    if not isinstance(methods, list) or not methods or not all(isinstance(m, str) for m in methods):
        raise RamDistError(f"{p}: sweep: methods must be a list of method names")
    for m in methods:
        if m not in method_parameters.PARAMETERS:
            raise RamDistError(f"{p}: sweep: method {m!r} is not supported; use one of "
                               f"{_method_list()}")  # fmt: skip
    grid = raw.get("grid", {})
    if not isinstance(grid, dict) or not all(isinstance(k, str) for k in grid):
        raise RamDistError(f"{p}: sweep: grid must map a parameter to its values")
    values = {k: tuple(v) if isinstance(v, list) else (v,) for k, v in grid.items()}
    return {"methods": tuple(methods), "grid": values}


def parse_setting(raw: Any, name: str, where: str = "") -> ParamValue:
    """One raw YAML setting of parameter `name` as a checked `ParamValue`.

    Converted as in a configuration file (numbers to float, `1e-5` strings included); raises
    `RamDistError` naming `where` and `name` on a bad value or an unknown parameter name.
    """
    prefix = f"config {where}" if where else "parameter"
    if name not in method_parameters.BY_NAME:
        valid = ", ".join(method_parameters.BY_NAME)
        raise RamDistError(f"{prefix}: unknown parameter {name!r}; valid: {valid}")
    return _setting(raw, name, prefix, name, [])


def _method_list() -> str:
    return ", ".join(method_parameters.PARAMETERS)


def _model_name(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RamDistError(f"{at} must be a folder, URL or Hugging Face id (a string)")
    if "+" in value:
        raise RamDistError(
            f"{at}: {value!r} is a model+LoRA reference (mergekit's '+'): the base model is a "
            "model, not a model with an adapter; give the adapter as one of the models "
            "(`model: BASE+ADAPTER`)"
        )
    return value


def _task_name(value: Any, base: str | None, at: str) -> str:
    """A model entry's location; mergekit's `BASE+ADAPTER` names the adapter folder, a task
    whose value is the base with the adapter merged in (`docs/inputs.md`), so BASE must be
    the base_model."""
    if not isinstance(value, str) or "+" not in value:
        return _model_name(value, at)
    model, _, adapter = value.partition("+")
    if not model.strip() or not adapter.strip() or "+" in adapter:
        raise RamDistError(
            f"{at}: {value!r} is not MODEL+ADAPTER (mergekit's form: one '+' between a model "
            "and a LoRA adapter folder)"
        )
    if model != base:
        raise RamDistError(
            f"{at}: {value!r} applies the adapter to {model!r}, which is not the base_model "
            f"({base!r}): ram-dist merges an adapter into the base only; set base_model to "
            f"{model!r}, or merge the adapter into {model!r} first"
        )
    return adapter


def _models(
    raw: Any,
    base: str | None,
    table: tuple[Parameter, ...],
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
        _refuse_unknown_keys(entry, _MODEL_KEYS, f"{p}: {at}")
        if "model" not in entry:
            raise RamDistError(f"{p}: {at} needs a model: PATH")
        name = _task_name(entry["model"], base, f"{p}: {at}.model")
        if name in seen:
            raise RamDistError(f"{p}: {at}: {name} is listed twice (also models[{seen[name]}])")
        seen[name] = i
        params = _parameters(
            entry.get("parameters"), table, method, p, f"{at}.parameters", notes, per_model=True
        )
        if name == base:
            base_listed = True
            if get_method(method).needs_base:
                if params:
                    notes.append(
                        f"{at} is the base_model: its parameters ({', '.join(params)}) are "
                        f"ignored, as mergekit ignores them for the base in {method}"
                    )
                continue
        models.append(ModelSpec(model=name, parameters=params))
    if not get_method(method).needs_base and base is not None and not base_listed:
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
    table: tuple[Parameter, ...],
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
    shared = tuple(q.name for q in table if q.effect and not q.per_task)
    per_model_names = tuple(q.name for q in table if q.effect and q.per_task)
    no_effect = tuple(q.name for q in table if not q.effect)
    known = shared + per_model_names + no_effect
    values: dict[str, ParamValue] = {}
    for name, setting in raw.items():
        if name not in method_parameters.BY_NAME:
            valid = per_model_names if per_model else known
            raise RamDistError(
                f"{p}: {at}: unknown parameter {name!r}; valid for {method}"
                f"{' per model' if per_model else ''}: {', '.join(valid) or '(none)'}"
            )
        value = _setting(setting, name, p, f"{at}.{name}", notes)
        if name in no_effect:
            notes.append(f"{at}.{name} accepted and ignored: it has no effect in {method}")
        elif name not in known:
            notes.append(
                f"{at}.{name} ignored: {method} has no parameter {name} (mergekit ignores it)"
            )
        elif per_model and name not in per_model_names:
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


def _refuse_unknown_keys(
    raw: dict[Any, Any], allowed: tuple[str, ...], where: str, kind: str = ""
) -> None:
    """A mapping's first unknown key (in sorted order), named with the keys it may have."""
    unknown = sorted(set(raw) - set(allowed), key=str)
    if unknown:
        raise RamDistError(
            f"{where}: unknown key {unknown[0]!r}{kind}; valid keys: {', '.join(allowed)}"
        )


def _entry(raw: dict[Any, Any], name: str, p: str, at: str) -> FilterEntry:
    _refuse_unknown_keys(raw, _ENTRY_KEYS, f"{p}: {at}", " in a filter entry")
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
    declared = method_parameters.BY_NAME[name]
    kind = declared.kind
    if kind is int:  # ram-dist's own seed: an integer, not a bool
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise RamDistError(f"{p}: {at} must be an integer, got {raw!r}")
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
    choices = declared.choices
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
