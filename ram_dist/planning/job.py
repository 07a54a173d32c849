"""A merge job once its inputs are known: checked headers, the layout, the work units.

Built on the driver from headers only, before any tensor byte is read.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ram_dist.errors import CheckpointError, RamDistError
from ram_dist.io.checkpoint import Checkpoint, open_checkpoints, trained_on_config
from ram_dist.io.locations import resolve_location, resolve_output
from ram_dist.io.same_bytes import differing
from ram_dist.io.storage import Storage
from ram_dist.methods import MergeMethod, get_method
from ram_dist.planning.adapters import check_trained_on
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.devices import DeviceChoice, job_device
from ram_dist.planning.layout import Layout, TensorEntry, build_layout
from ram_dist.planning.packed_sources import PackedIntSource, check_shapes
from ram_dist.planning.precision import measured_against
from ram_dist.planning.sizing import auto_unit_budget, machine
from ram_dist.planning.sources import TensorSource, same_as_base
from ram_dist.planning.tensor_params import resolve_all
from ram_dist.planning.units import WorkUnit, plan_units


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
    params: dict[str, dict[str, Any]]
    """Per participating tensor, every parameter of the method, resolved and checked."""
    unit_budget_bytes: int
    """The budget the units were planned with: the configured one, or `sizing`'s default."""
    integers_changed: tuple[str, ...] = ()
    """Integer or bool tensors some task changed, copied from the base as the user asked
    (`integers_from_base`); a job without that permission stops before it gets here."""
    composite: MergeMethod | None = None
    """The method when it is not the config's: a sweep's variants driven as one
    (`planning.sweep`), whose parameters per tensor are the variants'."""
    outputs: int = 1
    """Outputs its map pass makes (a sweep's variants): the unit budget is divided among
    them, so that a worker's output buffers stay within one merge's."""

    def replanned(self, slots: int, memory_bytes: int) -> Job:
        """The job with units re-planned for a cluster of `slots` cores and `memory_bytes`
        of memory, when the budget is not configured (the bytes do not change)."""
        if self.config.unit_budget_bytes is not None:
            return self
        budget = auto_unit_budget(self.largest_input_bytes(), slots, memory_bytes)
        budget = max(1, budget // self.outputs)
        if budget == self.unit_budget_bytes:
            return self
        units = plan_units(self.layout.slots(), budget)
        return dataclasses.replace(self, units=units, unit_budget_bytes=budget)

    def device_choice(self, gpus: int, cpus: int) -> DeviceChoice:
        """Where this job's units run on a cluster of `gpus` GPUs and `cpus` CPUs (raises
        for `--device cuda` without GPUs)."""
        config = self.config
        return job_device(
            config.device, gpus, cpus, self.layout, self.params, self.method, config.kernels
        )

    def largest_input_bytes(self) -> int:
        """Tensor bytes of the largest input checkpoint (what one pass reads from it)."""
        per_input = [0.0] * (len(self.tasks) + 1)
        for entry in self.layout.tensors.values():
            same = same_as_base(entry.sources)
            for i, src in enumerate(entry.sources):
                per_input[i] += 0 if same[i] else entry.numel * src.itemsize
        return round(max(per_input))

    @property
    def method(self) -> MergeMethod:
        return self.composite or get_method(self.config.method)

    @property
    def reduce_rounds(self) -> int:
        """Reduce rounds the job runs: the method's; a method without any gets one that only
        checks the inputs for NaN and Inf, unless `allow_nonfinite`."""
        return max(self.method.rounds, 0 if self.config.allow_nonfinite else 1)

    def numel(self) -> dict[str, int]:
        return {name: self.layout.tensors[name].numel for name in self.params}

    def unit_bytes(self, unit: WorkUnit, tensors: set[str] | None = None) -> int:
        """Input bytes a unit reads (only pieces of `tensors`, when given, as a reduce round
        does: those pieces are participating tensors), to the nearest byte (a packed input's
        bytes per element are a fraction)."""
        return round(self._unit_read(unit, tensors))

    def pass_bytes(self, tensors: set[str] | None = None) -> int:
        """Input bytes a pass reads (of `tensors` only, when given): its units', rounded
        once, so that a packed input counts its files' bytes however the units cut it."""
        return round(sum(self._unit_read(u, tensors) for u in self.units))

    def _unit_read(self, unit: WorkUnit, tensors: set[str] | None) -> float:
        per_element = self._read_per_element
        if tensors is None:
            return sum(p.numel * per_element[p.tensor] for p in unit.pieces)
        return sum(p.numel * per_element[p.tensor] for p in unit.pieces if p.tensor in tensors)

    @functools.cached_property
    def _read_per_element(self) -> dict[str, float]:
        """Per tensor, the bytes one element costs to read from every input it is read from
        (the base only for a copied tensor; a new FP8 scale, its block of the weight): known
        once, for the many calls of `unit_bytes`."""
        return {name: self.layout.read_bytes(name, 1) for name in self.layout.tensors}

    def check_packed_shapes(self) -> None:
        """Every packed INT weight's `weight_shape` against its words and scales, in every
        input (`packed_sources.check_shapes`): the one check that reads tensor values (a few
        bytes a weight), run once by `merge` and `probe` before any work; `plan` reads
        headers only and leaves it out."""
        inputs = [self.base, *self.tasks]
        check_shapes(
            [
                (src, inputs[i])
                for entry in self.layout.tensors.values()
                for i, src in enumerate(entry.sources)
                if isinstance(src, PackedIntSource)
            ],
            self.storage,
        )

    def effective_parameters(self) -> dict[str, Any]:
        """Every tensor's parameters, given once when all tensors got the same ones."""
        values = list(self.params.values())
        if values and all(v == values[0] for v in values):
            return dict(values[0])
        return {name: dict(p) for name, p in self.params.items()}

    def initial_state(self) -> dict[str, Any]:
        return self.method.initial_state(self.params, self.numel(), len(self.tasks))

    def identity(self) -> dict[str, Any]:
        """What determines the output bytes: the what-to-merge settings (`settings.WHAT`),
        resolved: the method, its parameters per tensor, the dtype and every input file.
        The how-to-run settings never change a byte, so are not part of it."""
        inputs = [self.base, *self.tasks]
        identity = {  # each key is a `Setting.identity` (tests/entry/test_settings.py)
            "method": self.method.name,
            "parameters": self.effective_parameters(),
            "out_dtype": self.config.out_dtype,
            "inputs": [{"role": c.label, "location": c.url, "files": c.identity} for c in inputs],
        }
        if self.layout.decoded_inputs:  # how FP8 inputs are decoded decides the bytes
            identity["formats"] = list(self.layout.formats)
        against = self.measured_against
        if against:  # what a task is measured against decides the bytes
            identity["measured_against"] = list(against)
        return identity

    @functools.cached_property
    def measured_against(self) -> list[str]:
        """The tasks measured against the base at another precision than the base's own,
        in words (`planning.precision`; a pass over every tensor, made once per job)."""
        return measured_against(self.layout, [t.label for t in self.tasks])

    def extra_tensors(self) -> dict[str, Any]:
        """`--drop-extra-tensors` and what it left out, per task (plan, report, card)."""
        dropped = {label: list(names) for label, names in self.layout.dropped.items()}
        return {"allowed": self.config.drop_extra_tensors, "dropped": dropped}

    def formats(self) -> dict[str, Any]:
        """Each input's storage format and the output's, in words (plan, report, card)."""
        inputs = [self.base, *self.tasks]
        return {
            "inputs": [
                {"role": c.label, "format": f}
                for c, f in zip(inputs, self.layout.formats, strict=True)
            ],
            "output": self.layout.output_format(),
            "measured_against": list(self.measured_against),
        }


def prepare(config: MergeConfig) -> Job:
    """Resolve locations, read every header, check that the inputs fit, plan the work.

    Planning allocates a few objects per tensor and input, millions for a large MoE
    checkpoint, and frees almost none until it ends: the engine runs it with Python's
    cyclic garbage collector paused (`engine.driver.prepare`, `engine.collector`)."""
    return plan_job(config, open_inputs(config))


@dataclass(frozen=True)
class Inputs:
    """A job's inputs as read from their headers, whatever the method: what a sweep's
    variants share, read once for all of them (`planning.sweep`)."""

    storage: Storage
    base: Checkpoint
    tasks: list[Checkpoint]
    layout: Layout
    """Before any method asks for whole rows."""
    integers_changed: tuple[str, ...]


def open_inputs(config: MergeConfig, methods: tuple[str, ...] = ()) -> Inputs:
    """Resolve the inputs' locations, read every header (and the copied integer tensors'
    bytes some task may have changed), check that they fit together: once for every method
    of `methods` (default: the config's), checked against each before anything is read."""
    storage = Storage(config.storage_options)
    base_url = resolve_location(config.base, "base model")
    task_urls = [resolve_location(loc, f"task {i + 1}") for i, loc in enumerate(config.tasks)]
    for method in methods or (config.method,):
        _check_distinct(base_url, task_urls, method)
    labelled = [(url, f"task {i + 1}") for i, url in enumerate(task_urls)]
    base, *tasks = open_checkpoints([(base_url, "base model"), *labelled], storage)
    for task in tasks:
        if task.adapter is not None and base.adapter is None:
            named = task.adapter.get("base_model_name_or_path")
            trained_on = trained_on_config(named, base_url, storage)
            check_trained_on(task, trained_on, base)
    layout = build_layout(base, tasks, config.out_dtype, config.drop_extra_tensors)
    integers_changed = _changed_integers(layout, storage, base, tasks, config)
    return Inputs(storage, base, tasks, layout, integers_changed)


def plan_job(config: MergeConfig, inputs: Inputs) -> Job:
    """The job of `config`'s method and parameters over inputs already read: parameters
    resolved per tensor, whole rows where the method needs them, the work units."""
    layout = inputs.layout
    merging = [name for name, e in layout.tensors.items() if e.participating]
    method = get_method(config.method)
    params = resolve_all(config, method, merging)
    layout = layout.in_whole_rows(n for n in merging if method.whole_rows(params[n]))
    out = resolve_output(config.out) if config.out is not None else None
    job = Job(
        config=config, storage=inputs.storage, base=inputs.base, tasks=inputs.tasks,
        layout=layout, units=[], out=out, params=params, unit_budget_bytes=0,
        integers_changed=inputs.integers_changed,
    )  # fmt: skip
    budget = config.unit_budget_bytes
    if budget is None:  # this machine's default; `replanned` adapts it to the cluster
        budget = auto_unit_budget(job.largest_input_bytes(), *machine())
    return dataclasses.replace(
        job, units=plan_units(layout.slots(), budget), unit_budget_bytes=budget
    )


def _changed_integers(
    layout: Layout, storage: Storage, base: Checkpoint, tasks: list[Checkpoint], config: MergeConfig
) -> tuple[str, ...]:
    """The copied (integer or bool) tensors whose bytes some task changed: refused, naming
    the first, unless the config says to copy the base's anyway."""
    copied = {
        name: [
            _stored_range(e, s if not same else e.sources[0])
            for s, same in zip(e.sources, same_as_base(e.sources), strict=True)
        ]
        for name, e in layout.tensors.items()
        if not e.participating and e.scale_of is None and len(e.sources) > 1
    }
    changed = differing(copied, storage) if copied else {}
    if changed and not config.integers_from_base:
        name, first = next(iter(changed.items()))
        dtype = layout.tensors[name].sources[0].dtype
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise CheckpointError(
            f"tensor {name!r} ({dtype}) in {tasks[first - 1].describe(name)} differs from the "
            f"{base.describe(name)}{more}: integer and bool tensors cannot be merged, and "
            "copying the base's would drop the task's change; fix the task, or pass "
            "--integers-from-base to copy the base's anyway (the report and the model card "
            "say so)"
        )
    return tuple(changed)


def _stored_range(entry: TensorEntry, src: TensorSource) -> tuple[str, int, int]:
    """Where a copied tensor's bytes lie in one input (a task's that is the base's own, in
    the base: the same bytes)."""
    return (src.file, src.start, src.start + entry.numel * int(src.itemsize))


def _check_distinct(base: str, tasks: list[str], method: str) -> None:
    """The same checkpoint twice, or the base as a task, is a mistake (except for `linear`,
    which averages its inputs and may list the base among them, as mergekit does)."""
    seen: dict[str, int] = {}
    for i, url in enumerate(tasks):
        if url == base and get_method(method).needs_base:
            raise RamDistError(
                f"task {i + 1} ({url}) is the base model; tasks are the models fine-tuned from it"
            )
        if url in seen:
            raise RamDistError(
                f"task {seen[url] + 1} and task {i + 1} are the same checkpoint ({url}); "
                "give each task once"
            )
        seen[url] = i
