"""The merge job's settings, from the command line or a mergekit-style YAML file.

Everything is checked here, when the job starts, never in the middle of a merge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ram_dist.dtypes import parse_out_dtype
from ram_dist.errors import RamDistError
from ram_dist.io.range_cache import MODES as CACHE_MODES
from ram_dist.io.storage import Storage
from ram_dist.methods import get_method
from ram_dist.planning.devices import DEVICES


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """One merge (or probe) job."""

    base: str
    """The checkpoint every task was trained from (folder or URL)."""
    tasks: tuple[str, ...]
    """Task checkpoints, in order; the order is part of the result."""
    out: str | None = None
    """Output folder; None for `probe`, which writes no model."""
    method: str = "ram_plus"
    """A merge method of `ram_dist.methods.METHODS` (ram, ram_plus, ties, ...)."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The method's parameters by mergekit's names (`methods.parameters.PARAMETERS`): its
    global ones, and defaults for every task of its per-task ones; missing ones take the
    method's defaults."""
    task_parameters: tuple[dict[str, Any], ...] = ()
    """Per-task parameters (weight, density), in task order; empty: none given."""
    out_dtype: str | None = None
    """Safetensors dtype of merged floating tensors; None keeps each base tensor's dtype."""
    unit_budget_bytes: int | None = None
    """Bytes one work unit may read from each input; None: chosen from the cluster's cores
    and memory (`planning.sizing`, at most 256 MiB)."""
    workers: int | None = None
    """CPU tasks running at once; None uses every CPU the GPU workers leave (the GPU workers
    are one per GPU, whatever this says)."""
    device: str = "auto"
    """`auto`: every CPU with the fused kernels, and, on a cluster with GPUs, the units of
    tensors that need the eager rule on one worker per GPU; `cpu`: every unit on the CPUs;
    `cuda`: every unit on the GPU workers, refusing a cluster without GPUs
    (`planning.devices`). Never changes a byte."""
    address: str | None = None
    """Ray cluster address; None uses RAY_ADDRESS or starts a local Ray."""
    overwrite: bool = False
    """Replace an output folder that already holds files."""
    output_shared: bool = False
    """The local output folder is one filesystem mounted on every node of the cluster, so
    workers write their parts there themselves (on several nodes without it, the driver
    streams the output)."""
    kernels: str = "auto"
    """`auto`: fused CPU kernels where they apply (same bytes); `eager`: plain torch only."""
    log_format: str = "text"
    """`text` (a progress bar on a terminal) or `json` (one JSON object per line on stderr)."""
    allow_nonfinite: bool = False
    """Merge inputs holding NaN or Inf instead of refusing them."""
    integers_from_base: bool = False
    """Copy the base's integer and bool tensors even where a task's bytes differ (they
    cannot be merged); without it such a task is refused before any work."""
    input_cache: str = "auto"
    """Keep what the first pass fetched on each node's disk for the later passes: `auto`
    (inputs not on a local filesystem), `on` (every input) or `off`. Never changes a byte."""
    cache_dir: str | None = None
    """Node-local folder for that cache; None: a private folder in each node's temp dir."""
    notes: tuple[str, ...] = ()
    """What the config asked for that was accepted but ignored or changed."""
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    """fsspec options per protocol, e.g. {"s3": {"endpoint_url": ...}}; may hold secrets."""

    def __post_init__(self) -> None:
        if len(self.tasks) < 2:
            raise RamDistError(
                f"RAM merges two or more task models into one; got {len(self.tasks)} "
                "(give --task once per model)"
            )
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "out_dtype", parse_out_dtype(self.out_dtype))
        if self.task_parameters and len(self.task_parameters) != len(self.tasks):
            raise RamDistError(
                f"{len(self.task_parameters)} sets of per-task parameters for "
                f"{len(self.tasks)} tasks"
            )
        object.__setattr__(self, "task_parameters", tuple(self.task_parameters))
        get_method(self.method)  # raises on an unknown method
        if self.device not in DEVICES:
            raise RamDistError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.kernels not in ("auto", "eager"):
            raise RamDistError(f"kernels must be auto or eager, got {self.kernels!r}")
        if self.log_format not in ("text", "json"):
            raise RamDistError(f"log format must be text or json, got {self.log_format!r}")
        if self.input_cache not in CACHE_MODES:
            raise RamDistError(f"input cache must be auto, on or off, got {self.input_cache!r}")
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
    if spec.out_dtype is not None:
        kwargs["out_dtype"] = spec.out_dtype
    if spec.device is not None:
        kwargs["device"] = spec.device
    if spec.storage_options:
        kwargs["storage_options"] = {k: dict(v) for k, v in spec.storage_options.items()}
    return kwargs
