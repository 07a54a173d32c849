"""The merge job's settings, from the command line or a mergekit-style YAML file.

Everything is checked here, when the job starts, never in the middle of a merge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from ram_dist.dtypes import parse_out_dtype
from ram_dist.errors import RamDistError
from ram_dist.io.storage import Storage
from ram_dist.methods import get_method

DEFAULT_CHUNK_MB = 256.0

#: YAML parameter names (mergekit's) to ram-dist's.
PARAMETER_NAMES = {"r": "r", "alpha": "alpha", "epsilon": "eps", "eps": "eps"}
YAML_KEYS = ("merge_method", "base_model", "models", "parameters", "out_dtype", "storage_options")


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
    """A registered merge method: ram, ram_plus, ram_plus_soft."""
    parameters: dict[str, float] = field(default_factory=dict)
    """Method parameters (r, alpha, eps); missing ones take the method's defaults."""
    out_dtype: str | None = None
    """Safetensors dtype of merged floating tensors; None keeps each base tensor's dtype."""
    chunk_bytes: int = int(DEFAULT_CHUNK_MB * 2**20)
    """Bytes one work unit may read from each input."""
    workers: int | None = None
    """Work units running at once; None uses every CPU (or GPU) of the cluster."""
    address: str | None = None
    """Ray cluster address; None uses RAY_ADDRESS or starts a local Ray."""
    overwrite: bool = False
    """Replace an output folder that already holds files."""
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
        self.method_params()  # raises on unknown method or bad parameters
        if self.chunk_bytes <= 0:
            raise RamDistError(f"chunk budget must be positive, got {self.chunk_bytes} bytes")
        if self.workers is not None and self.workers < 1:
            raise RamDistError(f"workers must be >= 1, got {self.workers}")
        Storage(self.storage_options)  # raises on a malformed mapping

    def method_params(self) -> Any:
        """The method's validated parameter object."""
        return get_method(self.method).params(**self.parameters)


def load_yaml(path: str) -> dict[str, Any]:
    """Read a mergekit-style YAML file into `MergeConfig` keyword arguments."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise RamDistError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        raise RamDistError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise RamDistError(f"config {path}: expected a mapping with keys {', '.join(YAML_KEYS)}")
    unknown = sorted(set(raw) - set(YAML_KEYS))
    if unknown:
        raise RamDistError(
            f"config {path}: unknown key {unknown[0]!r}; valid keys: {', '.join(YAML_KEYS)}"
        )
    if "base_model" not in raw:
        raise RamDistError(f"config {path}: base_model is required")
    base = str(raw["base_model"])
    models = raw.get("models") or []
    if not isinstance(models, list):
        raise RamDistError(f"config {path}: models must be a list of {{model: PATH}}")
    tasks = []
    for entry in models:
        model = entry.get("model") if isinstance(entry, dict) else None
        if not isinstance(model, str):
            raise RamDistError(f"config {path}: each models entry needs a model: PATH")
        if model != base:  # mergekit lists the base among the models; it is not a task
            tasks.append(model)
    kwargs: dict[str, Any] = {"base": base, "tasks": tuple(tasks)}
    if "merge_method" in raw:
        kwargs["method"] = str(raw["merge_method"])
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise RamDistError(f"config {path}: parameters must be a mapping")
    for key, value in params.items():
        if key not in PARAMETER_NAMES:
            raise RamDistError(
                f"config {path}: unknown parameter {key!r}; valid: {', '.join(PARAMETER_NAMES)}"
            )
        kwargs.setdefault("parameters", {})[PARAMETER_NAMES[key]] = _number(value)
    if raw.get("out_dtype") is not None:
        kwargs["out_dtype"] = str(raw["out_dtype"])
    if raw.get("storage_options") is not None:
        kwargs["storage_options"] = raw["storage_options"]
    return kwargs


def _number(value: Any) -> Any:
    """YAML 1.1 reads `1e-5` (no dot) as a string; accept it as the number it means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
