"""ram-dist from Python: `merge`, `probe`, `plan` and `verify`, with the command line's
settings as keyword arguments, each returning a report object. Driver side.

    import ram_dist
    report = ram_dist.merge(base="./qwen-base", tasks=["./coder", "./tool-user"], out="./merged")

The `ram-dist` command and `jobs/nightly.py` are layers over this module: the command builds
its job with `build_job`, as every call here does. A setting left at None takes the mergekit
config's value where `config` gives one, else `MergeConfig`'s default, which is the command
line's too. An error the user can fix raises `RamDistError` with the
message the command prints. A Ray this process is already connected to (a notebook's
`ray.init()`) is used and left running; otherwise `address`, else `RAY_ADDRESS`, else an
embedded Ray that is stopped before the call returns.

Light to import: torch, Ray and the engine are imported by the calls that need them, so
`import ram_dist` and `ram_dist.verify` load neither.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ram_dist import API, settings
from ram_dist.errors import RamDistError
from ram_dist.report.api_reports import (  # noqa: F401  (exported: `API`)
    MergeReport,
    PlanReport,
    ProbeReport,
    Report,
    VerifyResult,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    from ram_dist.planning.config import MergeConfig

    ConfigSource: TypeAlias = MergeConfig | Callable[[], MergeConfig]
    """A ready job, or a function that builds it (built, and so checked, while Ray starts)."""

__all__ = list(API)  # the package exports the same names (`ram_dist.API`)

PathLike = settings.PathLike
#: The command line's parameter flags, as `build_job` reads them once it knows the method and
#: the number of tasks: (parameters set once, one mapping per task).
FlagValues = Callable[[str, int], tuple[dict[str, Any], list[dict[str, Any]]]]


# --------------------------------------------------------------------------------------------
# The calls. Their keywords are the job's settings (`ram_dist.settings`), each None or off by
# default: the value then comes from the config file, else the setting's default. They are
# written out, so that `help()`, IDEs and type checkers see them;
# `tests/entry/test_api_signatures.py` holds them to `settings.py` (a setting added there
# fails it until the calls take it).


def merge(
    *,
    config: PathLike | Mapping[str, Any] | None = None,
    base: PathLike | None = None,
    tasks: Sequence[PathLike] | None = None,
    method: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    task_parameters: Sequence[Mapping[str, Any]] | None = None,
    out_dtype: str | None = None,
    out: PathLike,
    overwrite: bool = False,
    output_shared: bool = False,
    storage_options: Mapping[str, Mapping[str, Any]] | None = None,
    integers_from_base: bool = False,
    drop_extra_tensors: bool = False,
    allow_nonfinite: bool = False,
    unit_budget_bytes: int | None = None,
    workers: int | None = None,
    device: str | None = None,
    address: str | None = None,
    kernels: str | None = None,
    input_cache: str | None = None,
    cache_dir: PathLike | None = None,
    log_format: str | None = None,
    methods: Sequence[str] | None = None,
    grid: Mapping[str, Sequence[Any]] | None = None,
) -> MergeReport:
    """Merge `tasks` into `base`, or run (resume) an unfinished merge into `out`, as
    `ram-dist merge` does; the arguments are `job_config`'s."""
    given = dict(locals())
    return run_merge(partial(job_config, **given), address=address)


def probe(
    *,
    config: PathLike | Mapping[str, Any] | None = None,
    base: PathLike | None = None,
    tasks: Sequence[PathLike] | None = None,
    method: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    task_parameters: Sequence[Mapping[str, Any]] | None = None,
    out_dtype: str | None = None,
    storage_options: Mapping[str, Mapping[str, Any]] | None = None,
    integers_from_base: bool = False,
    drop_extra_tensors: bool = False,
    allow_nonfinite: bool = False,
    unit_budget_bytes: int | None = None,
    workers: int | None = None,
    device: str | None = None,
    address: str | None = None,
    kernels: str | None = None,
    input_cache: str | None = None,
    cache_dir: PathLike | None = None,
    log_format: str | None = None,
    json_path: PathLike | None = None,
) -> ProbeReport:
    """RAM's first pass only, whatever `method` says (`ram-dist probe`): the statistics of
    the tasks. `json_path`: also write the report there, and beside it STEM.figure2.png,
    STEM.layers.csv and STEM.layers.png. The other arguments are `job_config`'s."""
    given = dict(locals())
    del given["json_path"]
    return run_probe(partial(job_config, **given), address=address, json_path=json_path)


def plan(
    *,
    config: PathLike | Mapping[str, Any] | None = None,
    base: PathLike | None = None,
    tasks: Sequence[PathLike] | None = None,
    method: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    task_parameters: Sequence[Mapping[str, Any]] | None = None,
    out_dtype: str | None = None,
    out: PathLike | None = None,
    overwrite: bool = False,
    output_shared: bool = False,
    storage_options: Mapping[str, Mapping[str, Any]] | None = None,
    integers_from_base: bool = False,
    drop_extra_tensors: bool = False,
    allow_nonfinite: bool = False,
    unit_budget_bytes: int | None = None,
    workers: int | None = None,
    device: str | None = None,
    address: str | None = None,
    kernels: str | None = None,
    input_cache: str | None = None,
    cache_dir: PathLike | None = None,
    log_format: str | None = None,
    methods: Sequence[str] | None = None,
    grid: Mapping[str, Sequence[Any]] | None = None,
) -> PlanReport:
    """Headers only (`ram-dist plan`): every check that needs no tensor data, then what a
    merge would read, run and write. Writes nothing and starts no Ray. The arguments are
    `job_config`'s."""
    return run_plan(partial(job_config, **locals()))


def verify(
    out: PathLike, *, storage_options: Mapping[str, Mapping[str, Any]] | None = None
) -> VerifyResult:
    """Re-hash every shard of the merged output `out` against its manifest and check the
    index (`ram-dist verify`). Reads only `out`."""
    from ram_dist.io.storage import Storage
    from ram_dist.io.verify import verify as verify_output

    location = os.fspath(out)
    problems, checked = verify_output(location, Storage(storage_options or {}))
    return VerifyResult(out=location, problems=tuple(problems), shards_checked=checked)


def job_config(
    *,
    config: PathLike | Mapping[str, Any] | None = None,
    base: PathLike | None = None,
    tasks: Sequence[PathLike] | None = None,
    method: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    task_parameters: Sequence[Mapping[str, Any]] | None = None,
    out_dtype: str | None = None,
    out: PathLike | None = None,
    overwrite: bool = False,
    output_shared: bool = False,
    storage_options: Mapping[str, Mapping[str, Any]] | None = None,
    integers_from_base: bool = False,
    drop_extra_tensors: bool = False,
    allow_nonfinite: bool = False,
    unit_budget_bytes: int | None = None,
    workers: int | None = None,
    device: str | None = None,
    address: str | None = None,
    kernels: str | None = None,
    input_cache: str | None = None,
    cache_dir: PathLike | None = None,
    log_format: str | None = None,
    methods: Sequence[str] | None = None,
    grid: Mapping[str, Sequence[Any]] | None = None,
) -> MergeConfig:
    """The checked job: `config` (a mergekit YAML file's path, or its keys as a mapping),
    then every argument given over it, as the command line's flags go over the file.

    `base`, `tasks` (in order; the order is part of the result), `out`: folders or URLs
    (`s3://`, `gs://`, `hf://`, a Hugging Face id), as `--base`, `--task`, `--out`.
    `parameters`: the method's global parameters by mergekit's names (`r`, `alpha`,
    `epsilon`, `lambda`, `normalize`, `rescale`, `seed`, and `weight`, `density` for every
    task), each a value, a list across the layers or `{filter, value}` entries as in the YAML
    file; they go over the file's key by key. `task_parameters`: one mapping per task
    (`weight`, `density`), over the file's per-model parameters. `unit_budget_bytes`: `--unit-mb`
    in bytes. `storage_options`: fsspec options per protocol. The rest are the flags of the
    same names; see `ram_dist.settings` for each one's meaning and default.
    """
    given = dict(locals())
    return build_job(given.pop("config"), given)


def build_job(
    config: PathLike | Mapping[str, Any] | None,
    given: Mapping[str, Any],
    flags: FlagValues | None = None,
) -> MergeConfig:
    """The one builder of a job, for `job_config` (so for every call above) and for the
    command line (`cli.config_from_args`): `config`'s settings, then each setting `given`
    (None: not given) over them. `flags`: the command line's parameter flags, read once the
    method and the number of tasks are known (the flags', else the file's)."""
    from ram_dist.planning.config import build, load_yaml

    if config is None:
        file: dict[str, Any] = {}
    else:
        file = load_yaml(config if isinstance(config, Mapping) else os.fspath(config))
    given = {name: _fspath(value) for name, value in given.items()}
    tasks = given.get("tasks")
    if tasks is not None:
        if isinstance(tasks, (str, os.PathLike)):
            raise RamDistError(f"tasks must be a list of checkpoints, got one: {tasks!r}")
        given["tasks"] = tuple(os.fspath(t) for t in tasks)
    if given.get("parameters") is not None:
        given["parameters"] = _parameter_values(given["parameters"]) or None
    if given.get("task_parameters") is not None:
        given["task_parameters"] = tuple(_parameter_values(p) for p in given["task_parameters"])
    if given.get("methods") is not None:
        if isinstance(given["methods"], str):
            raise RamDistError(f"methods must be a list of methods, got one: {given['methods']!r}")
        given["methods"] = tuple(given["methods"])
    if given.get("storage_options") is not None:
        given["storage_options"] = dict(given["storage_options"])
    if flags is not None:
        method = given.get("method") or file.get("method") or settings.BY_NAME["method"].default
        n_tasks = len(given.get("tasks") or file.get("tasks", ()))
        parameters, per_task = flags(method, n_tasks)
        for other in given.get("methods") or file.get("methods") or ():
            flags(other, n_tasks)  # a sweep: each method refuses a flag it means otherwise
        given["parameters"] = parameters or None
        given["task_parameters"] = tuple(per_task) or None
    return build(file, given)


def run_merge(config: ConfigSource, *, address: str | None = None) -> MergeReport:
    """`merge` of a ready `MergeConfig` (as mergekit's `run_merge` takes its configuration),
    or of what `config()` builds: then it runs, with every check and the claim on the output,
    while Ray starts, and `address` names the cluster (else a ready config's own)."""
    from ram_dist.engine.runtime import ray_session

    build, address = _source(config, address)

    def checks(held: contextlib.ExitStack) -> tuple[MergeConfig, Any]:
        from ram_dist.engine import driver, sweep  # the engine, torch: while Ray starts

        job = build()
        if job.sweeps:  # many merges for the reads of one (docs/sweeps.md)
            return job, sweep.sweep_checks(job, held)
        return job, driver.merge_checks(job, held)

    with contextlib.ExitStack() as held:  # this run's lease on the output, released last
        with ray_session(address, partial(checks, held)) as (cluster, (job, claim)):
            from ram_dist.engine import driver, sweep
            from ram_dist.report.model_card import model_card

            if isinstance(claim, sweep.SweepClaim):
                report = sweep.sweep_on(claim, cluster, model_card)
            else:
                report = driver.merge_on(claim, cluster, model_card)
    return MergeReport.of(report, job)


def run_probe(
    config: ConfigSource, *, address: str | None = None, json_path: PathLike | None = None
) -> ProbeReport:
    """`probe` of a ready `MergeConfig`, or of what `config()` builds (see `run_merge`)."""
    from ram_dist.engine.runtime import ray_session
    from ram_dist.report.regime import place as place_on_regime_map
    from ram_dist.report.suggest import suggest as suggest_sweep

    build, address = _source(config, address)
    written = None if json_path is None else os.fspath(json_path)
    if written is not None:
        _make_folder_of(written)  # before any work, so that a bad path costs nothing

    def checks() -> tuple[MergeConfig, Any]:
        from ram_dist.engine import driver  # the engine and torch: imported while Ray starts

        job = build()
        if job.sweeps:
            raise RamDistError(
                "probe counts one method's statistics; a sweep (--method more than once, "
                "--grid) is for merge and plan"
            )
        return job, driver.probe_checks(job)

    with ray_session(address, checks) as (cluster, (job, planned)):
        from ram_dist.engine import driver

        report = driver.probe_on(planned, cluster)
    report["regime"] = place_on_regime_map(report)
    report["suggested_sweep"] = suggest_sweep(report, report["regime"])
    files = write_probe_files(report, written) if written is not None else []
    return ProbeReport.of(report, job, files)


def run_plan(config: ConfigSource) -> PlanReport:
    """`plan` of a ready `MergeConfig`, or of what `config()` builds."""
    from ram_dist.engine import driver

    job = _source(config, None)[0]()
    if job.sweeps:
        from ram_dist.engine.sweep import sweep_plan

        return PlanReport.of(sweep_plan(job), job)
    return PlanReport.of(driver.plan(job), job)


def write_probe_files(report: Mapping[str, Any], json_path: str) -> list[str]:
    """The probe's JSON, and beside it the figures and the per-layer table."""
    from ram_dist.io.names import probe_files
    from ram_dist.io.writer import json_text
    from ram_dist.report.figures import write_figure2, write_layer_csv, write_layer_heatmap

    with open(json_path, "w", encoding="utf-8") as f:
        f.write(json_text(report))
    written = probe_files(json_path)
    write_figure2(report, written[1])
    write_layer_csv(report, written[2])
    write_layer_heatmap(report, written[3])
    return written


def _make_folder_of(path: str) -> None:
    """Create the folder `path` will be written to before any work, or say why not."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise RamDistError(f"cannot create {folder} for {path}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK):
        raise RamDistError(f"cannot write {path}: {folder} is not writable")


def _source(
    config: ConfigSource, address: str | None
) -> tuple[Callable[[], MergeConfig], str | None]:
    """(what builds the job, the Ray address to start with)."""
    if callable(config):
        return config, address
    return (lambda: config), address if address is not None else config.address


def _parameter_values(given: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters given in Python: a list (values across the layers, or `{filter, value}`
    entries) or a mapping is read as the YAML reader reads it; a plain value as a flag's."""
    from ram_dist.mergekit_config import parse_setting

    return {
        name: parse_setting(list(v) if isinstance(v, tuple) else v, name)
        if isinstance(v, (list, tuple, dict))
        else v
        for name, v in given.items()
    }


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value
