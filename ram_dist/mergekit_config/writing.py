"""The effective configuration of a merge, as the mergekit YAML file written beside the output.

It states what ran, not what was typed: every parameter the method was handed, with its
default filled in, and, where a value differs between tensors (layer gradients, filters), one
`{filter, value}` entry per tensor, longest names first so that mergekit's first-match rule
picks each tensor's own entry. Running it again (with ram-dist or mergekit) resolves every
tensor to the same values. Storage options are never written; the reader's notes are comments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ram_dist.dtypes import dtype_name
from ram_dist.methods import parameters as method_parameters
from ram_dist.methods.parameters import handed


def _setting(per_tensor: Mapping[str, Any]) -> Any:
    values = list(per_tensor.values())
    if all(v == values[0] for v in values):
        return values[0]
    names = sorted(per_tensor, key=lambda n: (-len(n), n))
    return [{"filter": n, "value": per_tensor[n]} for n in names]


def effective_config(
    method: str,
    base: str,
    tasks: Sequence[str],
    params: Mapping[str, Mapping[str, Any]],
    out_dtype: str | None,
) -> dict[str, Any]:
    """mergekit's schema for what ran: `params` holds every participating tensor's resolved
    parameters (`planning.tensor_params.resolve_all`), `out_dtype` the safetensors dtype
    written (None: each base tensor's)."""
    declared = handed(method_parameters.PARAMETERS[method])
    per_task = [p.name for p in declared if p.per_task]
    shared = [p.name for p in declared if not p.per_task]
    config: dict[str, Any] = {"merge_method": method, "base_model": base}
    models = []
    for t, task in enumerate(tasks):
        entry: dict[str, Any] = {"model": task}
        if params and per_task:
            entry["parameters"] = {
                key: _setting({n: p[key][t] for n, p in params.items()}) for key in per_task
            }
        models.append(entry)
    config["models"] = models
    if params and shared:
        config["parameters"] = {
            key: _setting({n: p[key] for n, p in params.items()}) for key in shared
        }
    config["dtype"] = "float32"
    if out_dtype is not None:
        config["out_dtype"] = dtype_name(out_dtype)
    config["tokenizer_source"] = "base"
    return config


def render(config: Mapping[str, Any], notes: Sequence[str]) -> str:
    """The file's text: `config` (from `effective_config`) as YAML, the notes of the reader
    as comments at the top."""
    lines = ["# Written by ram-dist: the configuration this merge ran with, resolved."]
    lines += [f"# note: {note}" for note in notes]
    body = yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body
