"""A merge job once its inputs are known: checked headers, the layout, the work units.

Built on the driver from headers only, before any tensor byte is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ram_dist.config import MergeConfig
from ram_dist.engine.layout import Layout, build_layout
from ram_dist.io.checkpoint import Checkpoint, open_checkpoint
from ram_dist.io.locations import resolve_location, resolve_output
from ram_dist.io.storage import Storage
from ram_dist.methods import MergeMethod, get_method
from ram_dist.plan import WorkUnit, plan_units


@dataclass(frozen=True)
class Job:
    """Everything known before any tensor byte is read."""

    config: MergeConfig
    storage: Storage
    base: Checkpoint
    tasks: list[Checkpoint]
    layout: Layout
    units: list[WorkUnit]
    out: str | None

    @property
    def method(self) -> MergeMethod:
        return get_method(self.config.method)

    @property
    def params(self) -> Any:
        return self.config.method_params()

    def identity(self) -> dict[str, Any]:
        """What determines the output bytes: method, parameters, dtype and every input file.

        Chunk size, worker count and cluster do not: they never change a byte.
        """
        inputs = [self.base, *self.tasks]
        return {
            "method": self.config.method,
            "parameters": _fields(self.params),
            "out_dtype": self.config.out_dtype,
            "inputs": [{"role": c.label, "location": c.url, "files": c.identity} for c in inputs],
        }


def prepare(config: MergeConfig) -> Job:
    """Resolve locations, read every header, check that the inputs fit, plan the work."""
    storage = Storage(config.storage_options)
    base = open_checkpoint(resolve_location(config.base, "base model"), "base model", storage)
    tasks = []
    for i, location in enumerate(config.tasks):
        label = f"task {i + 1}"
        tasks.append(open_checkpoint(resolve_location(location, label), label, storage))
    layout = build_layout(base, tasks, config.out_dtype)
    units = plan_units(layout.slots(), config.chunk_bytes)
    out = resolve_output(config.out) if config.out is not None else None
    return Job(config, storage, base, tasks, layout, units, out)


def _fields(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
