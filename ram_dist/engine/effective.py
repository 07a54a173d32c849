"""The effective configuration of a job, as a mergekit YAML file written beside the output.

It states what ran, not what was typed: every parameter with its default filled in, and,
where a value differs between tensors (layer gradients, filters), one `{filter, value}` entry
per tensor, longest names first so that mergekit's first-match rule picks each tensor's own
entry. Running it again (with ram-dist or mergekit) resolves every tensor to the same values.
"""

from __future__ import annotations

from typing import Any

import yaml

from ram_dist.dtypes import dtype_name
from ram_dist.engine.job import Job

CONFIG_NAME = "mergekit_config.yml"


def _setting(per_tensor: dict[str, Any]) -> Any:
    values = list(per_tensor.values())
    if all(v == values[0] for v in values):
        return values[0]
    names = sorted(per_tensor, key=lambda n: (-len(n), n))
    return [{"filter": n, "value": per_tensor[n]} for n in names]


def effective_config(job: Job) -> dict[str, Any]:
    """The job as mergekit's schema, resolved (storage options are never included)."""
    method = job.method
    params = job.params
    config: dict[str, Any] = {"merge_method": method.name, "base_model": job.config.base}
    models = []
    for t, task in enumerate(job.config.tasks):
        entry: dict[str, Any] = {"model": task}
        if params and method.task_parameters:
            entry["parameters"] = {
                key: _setting({n: p[key][t] for n, p in params.items()})
                for key in method.task_parameters
            }
        models.append(entry)
    config["models"] = models
    if params and method.global_parameters:
        config["parameters"] = {
            key: _setting({n: p[key] for n, p in params.items()})
            for key in method.global_parameters
        }
    config["dtype"] = "float32"
    if job.config.out_dtype is not None:
        config["out_dtype"] = dtype_name(job.config.out_dtype)
    config["tokenizer_source"] = "base"
    return config


def render(job: Job) -> str:
    """YAML text, with the reader's notes as comments at the top."""
    lines = ["# Written by ram-dist: the configuration this merge ran with, resolved."]
    lines += [f"# note: {note}" for note in job.config.notes]
    body = yaml.safe_dump(effective_config(job), sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body
