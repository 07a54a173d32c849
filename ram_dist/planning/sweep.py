"""A sweep's variants and the one job that makes them all (`docs/sweeps.md`). Driver side,
headers only.

`--method M1 --method M2 --grid NAME=V1,V2 ...` makes, per method, the Cartesian product of
the values of the grid names that method declares (a parameter it accepts for mergekit's
YAML only, without effect, is not declared); a method that declares none is one variant with
its settings as given. A grid name no chosen method declares is refused, as is a method that
cannot take the tasks, before any work. Each variant is a single merge's `MergeConfig` with
its own output folder under the sweep's (`ram_plus-r0.1-alpha2`); the sweep's `Job` drives
all of them as one (`methods.sweep.Variants`) with the unit budget divided among them, so
that a worker's output buffers stay within one merge's.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ram_dist.errors import RamDistError
from ram_dist.io.locations import resolve_output
from ram_dist.io.storage import join
from ram_dist.methods import get_method
from ram_dist.methods.parameters import Parameter
from ram_dist.methods.sweep import Variants
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.job import Job, open_inputs, plan_job
from ram_dist.planning.units import plan_units

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True)
class Variant:
    """One merge of a sweep: its folder's name, its method, the grid's values it takes, and
    its single merge's config (output: its folder under the sweep's)."""

    name: str
    method: str
    grid: dict[str, Any]
    config: MergeConfig


def declared(method: str) -> dict[str, Parameter]:
    """The parameters of `method` a grid may set: those with an effect."""
    return {p.name: p for p in get_method(method).parameters if p.effect}


def variants(config: MergeConfig) -> list[Variant]:
    """Every variant of a sweep's config, in order (methods as given, then grid points in
    the grid's order); raises `RamDistError` for a grid name no method declares, a value a
    method cannot read, or two variants of the same name."""
    if config.out is None:
        raise RamDistError("a sweep needs an output location: --out PATH")
    methods = config.methods or (config.method,)
    tables = {m: declared(m) for m in methods}
    for name in config.grid:
        if not any(name in t for t in tables.values()):
            raise RamDistError(
                f"grid {name}: no chosen method ({', '.join(methods)}) takes a parameter "
                f"{name!r}; a grid sets parameters the methods declare"
            )
    out: list[Variant] = []
    for method in methods:
        names = [n for n in config.grid if n in tables[method]]
        for values in itertools.product(*(config.grid[n] for n in names)):
            point = {
                n: _read(tables[method][n], v, method) for n, v in zip(names, values, strict=True)
            }
            label = "-".join([method, *(f"{n}{_text(v)}" for n, v in point.items())])
            given = {k: v for k, v in config.parameters.items() if k in tables[method]}
            per_task = tuple(
                {k: v for k, v in p.items() if k in tables[method]} for p in config.task_parameters
            )
            single = dataclasses.replace(
                config, method=method, methods=(), grid={}, parameters={**given, **point},
                task_parameters=per_task if any(per_task) else (), out=join(config.out, label),
            )  # fmt: skip
            out.append(Variant(label, method, point, single))
    seen = [v.name for v in out]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise RamDistError(f"the sweep names variant {twice[0]} twice: give each method once")
    return out


def _read(param: Parameter, value: Any, method: str) -> Any:
    """A grid value as `param` takes it (text from `--grid`), checked by its declaration."""
    where = f"grid {param.name} of {method}"
    if isinstance(value, str) and param.kind is not str:
        try:
            if param.kind is bool:
                if value.lower() not in _TRUE | _FALSE:
                    raise ValueError(value)
                value = value.lower() in _TRUE
            else:
                value = param.kind(value)
        except ValueError:
            kind = param.kind.__name__
            raise RamDistError(f"{where}: {value!r} is not a {kind}") from None
    values = value if param.per_task and isinstance(value, list) else [value]
    for v in values:
        param.validate(v, where)
    return value


def _text(value: Any) -> str:
    """A value as a folder name shows it: 2.0 as 2, 0.1 as 0.1, True as true."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).replace("/", "_")


@dataclass(frozen=True)
class Sweep:
    """A planned sweep: its variants with their single merges' jobs (for their identity,
    report, card and config), and the one job whose passes make them all."""

    variants: list[Variant]
    jobs: list[Job]
    job: Job


def prepare_sweep(config: MergeConfig) -> Sweep:
    """Every variant checked and planned as its single merge would be, from the inputs'
    headers read once for all of them (the variants differ only in method and parameters),
    then the sweep's job: the first variant's inputs and layout, every variant's parameters
    per tensor, whole rows wherever a variant needs them, and units planned with the budget
    divided among the variants (each output buffer of a map task is one variant's)."""
    chosen = variants(config)
    inputs = open_inputs(chosen[0].config, tuple(v.method for v in chosen))
    jobs = [plan_job(v.config, inputs) for v in chosen]
    first = jobs[0]
    methods = Variants(tuple(j.method for j in jobs))
    params = {name: {"variants": tuple(j.params[name] for j in jobs)} for name in first.params}
    layout = first.layout.in_whole_rows(n for n in params if methods.whole_rows(params[n]))
    job = dataclasses.replace(
        first, config=dataclasses.replace(first.config, out=config.out),
        out=resolve_output(config.out), layout=layout, params=params, composite=methods,
        outputs=len(jobs),
    )  # fmt: skip
    budget = max(1, first.unit_budget_bytes // len(jobs))
    job = dataclasses.replace(
        job, units=plan_units(layout.slots(), budget), unit_budget_bytes=budget
    )
    return Sweep(chosen, jobs, job)


def describe(sweep: Sweep) -> list[dict[str, Any]]:
    """What `sweep_report.json` and `plan` say of each variant: its name, method, resolved
    parameters and folder."""
    return [
        {
            "name": v.name,
            "method": v.method,
            "parameters": j.effective_parameters(),
            "out": j.out,
        }
        for v, j in zip(sweep.variants, sweep.jobs, strict=True)
    ]
