"""One merge configuration run by mergekit and by ram-dist, for the tests that compare the
two (`tests/exactness/test_*_vs_mergekit.py`): the config in mergekit's YAML form, mergekit's
own `run_merge` on it, and ram-dist's job read from the same YAML (`load_yaml`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from builders import load_checkpoint

from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig, load_yaml


def mergekit_config(
    method: str,
    base: Path | None,
    tasks: list[Path],
    params: dict[str, Any] | None = None,
    per_model: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A float32 merge of `tasks` onto `base` (None: none), with the method's `params` and
    each model's `per_model[i]` parameters."""
    config: dict[str, Any] = {"merge_method": method, "dtype": "float32", "models": []}
    if base is not None:
        config["base_model"] = str(base)
    for i, task in enumerate(tasks):
        entry: dict[str, Any] = {"model": str(task)}
        if per_model:
            entry["parameters"] = per_model[i]
        config["models"].append(entry)
    if params:
        config["parameters"] = params
    return config


def run_mergekit(config: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """mergekit's merge of `config` into `out` (skipped where mergekit is not installed)."""
    pytest.importorskip("mergekit", reason="mergekit is the oracle of these tests")
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions
    from mergekit.merge import run_merge as mergekit_merge

    mergekit_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True, copy_tokenizer=False),
    )
    return load_checkpoint(out)


def run_ours(
    config: dict[str, Any], out: Path, **overrides: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """ram-dist's merge of `config` (written as YAML beside `out`, read by `load_yaml`) into
    `out` in small units, with `overrides` of the job's settings: its tensors and report."""
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    kwargs = load_yaml(str(path)) | {"out": str(out), "unit_budget_bytes": 3000}
    report = run_merge(MergeConfig(**(kwargs | overrides))).data
    return load_checkpoint(out), report
