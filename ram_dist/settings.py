"""Every job setting, declared once: its type, default, allowed values, CLI flag, help and
YAML key. The command line's flags (`cli`), the API's keywords (`api`), the YAML keys a
config may set (`mergekit_config`) and `MergeConfig` (`config`) are made from here.

Two models, as mergekit's `MergeConfiguration` and `MergeOptions`: `WhatToMerge` decides the
output's bytes (and so the job's identity, which a resumed run must match); `HowToRun` never
changes a byte. A third, `SweepOver`, makes one job several (a sweep's variants). Adding a
setting is one field in one of them (see `docs/extending.md`).
Pure Python and light: `ram-dist --help` reads it without torch or Ray.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from fractions import Fraction
from typing import Any

from ram_dist.errors import RamDistError

#: `--device`: `auto` (fused CPU kernels on every CPU; eager units on the GPUs, if any),
#: `cpu`, `cuda` (`planning.devices`).
DEVICES = ("auto", "cpu", "cuda")
#: `--kernels`: fused CPU kernels where they apply, or plain torch.
KERNELS = ("auto", "eager")
#: `--log-format`: a progress bar on a terminal, or one JSON object per line on stderr.
LOG_FORMATS = ("text", "json")
#: `--input-cache`: `auto` keeps ranges of inputs not on a local filesystem, `on` of every
#: input (local ones too, e.g. on a network filesystem), `off` none.
INPUT_CACHES = ("auto", "on", "off")
#: The default unit budget (`--unit-mb`), as `planning.sizing.auto_unit_budget` chooses it
#: from the cluster: at least `UNITS_PER_SLOT` units per core over the largest input, at most
#: `MEMORY_SHARE` of a core's memory, within [`MIN_UNIT_BUDGET`, `MAX_UNIT_BUDGET`] bytes.
#: Below the smallest, per-unit overhead (a Ray task, a result) shows; a `--unit-mb` above
#: the largest only makes fewer, bigger units.
MIN_UNIT_BUDGET = 16 * 2**20
MAX_UNIT_BUDGET = 256 * 2**20
#: Units per core and pass, so that every core stays busy until near the end of a pass.
UNITS_PER_SLOT = 8
#: Share of a core's memory the merged bytes of its units may take (a unit's output is held
#: by its worker, and by Ray's object store where it goes through the driver; twice the
#: cores' units are in flight).
MEMORY_SHARE = 0.125
#: The commands that run a job.
COMMANDS = ("merge", "plan", "probe")
PathLike = str | os.PathLike[str]
"""A local path or a URL, as a string or a path object."""


@dataclass(frozen=True)
class Setting:
    """What a setting is beyond its type and default: the field's metadata."""

    help: str | Callable[[], str]
    """What it does, for `--help` (a function where it names what is known only later)."""
    default_text: str = ""
    """The default in words, for `--help` and `docs/cli.md`'s table; "": the default itself."""
    flag: str | None = None
    """The command-line flag; None: set from Python or YAML only."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """How argparse reads the flag's text (None: as text)."""
    convert: Callable[[Any], Any] | None = None
    """The flag's value to the field's (`--unit-mb` MiB to bytes)."""
    choices: tuple[str, ...] = ()
    commands: tuple[str, ...] = COMMANDS
    """The commands that take it; the API's `probe` takes those `probe` takes too."""
    yaml_key: str | None = None
    """The mergekit YAML key that sets it too (a flag goes over the file's value)."""
    api_type: Any = None
    """The API keyword's type, where it takes more than the field's (a path object)."""
    identity: str | None = None
    """The key of the job's identity that records it (what-to-merge settings only)."""
    repeat: bool = False
    """The flag may be given more than once: its values come as a list (a tuple-typed
    setting's flag always may)."""
    spill: str | None = None
    """A repeated flag's values beyond the first go to this other setting, with the first
    (`--method` twice: a sweep's `methods`); one value sets this setting alone."""


#: The default of a setting every job must give (base, tasks).
REQUIRED: Any = MISSING


def setting(default: Any = None, *, factory: Callable[[], Any] | None = None, **meta: Any) -> Any:
    """A field declared with its `Setting` (`REQUIRED`: no default)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"setting": Setting(**meta)})
    return field(default=default, metadata={"setting": Setting(**meta)})


def ray_address(given: str | None) -> str | None:
    """The Ray cluster a job runs on when this process is connected to none: `given`
    (`--address`), else `RAY_ADDRESS`; None: a local Ray, started for the job."""
    return given or os.environ.get("RAY_ADDRESS") or None


def _method_help() -> str:
    """A first line (what docs/cli.md's flag table shows), then one line per method."""
    from ram_dist.methods import METHODS

    listed = [f"{name}: {m.summary.replace('`', '')}" for name, m in METHODS.items()]
    first = "the merge rule, one of the methods below (more than once: a sweep)"
    return "\n".join([first, *listed])


def _mib(value: float) -> int:
    if not value > 0:
        raise RamDistError(f"--unit-mb must be positive, got {value}")
    return max(1, int(value * 2**20))


def _storage_options(text: str) -> dict[str, dict[str, Any]]:
    from ram_dist.io.storage import parse_storage_options

    return parse_storage_options(text)


@dataclass(frozen=True, kw_only=True)
class WhatToMerge:
    """The settings that decide the output's bytes: the job's identity."""

    base: str = setting(
        REQUIRED, help="base checkpoint folder the tasks were trained from", flag="--base",
        metavar="PATH", default_text="required", api_type=PathLike, identity="inputs",
    )  # fmt: skip
    tasks: tuple[str, ...] = setting(
        REQUIRED, help="task checkpoint folder, or PEFT LoRA adapter folder (repeat, in order)",
        flag="--task",
        metavar="PATH", convert=tuple, default_text="required, 2 or more",
        api_type=Sequence[PathLike], identity="inputs",
    )  # fmt: skip
    method: str = setting(
        "ram_plus", help=_method_help, flag="--method", identity="method", spill="methods"
    )  # fmt: skip
    parameters: dict[str, Any] = setting(
        factory=dict, help="the method's parameters by mergekit's names, and defaults for its "
        "per-task ones (`methods.parameters`); each has a flag of its own",
        api_type=Mapping[str, Any], identity="parameters",
    )  # fmt: skip
    task_parameters: tuple[dict[str, Any], ...] = setting(
        (), help="per-task parameters (weight, density), in task order; empty: none given",
        api_type=Sequence[Mapping[str, Any]], identity="parameters",
    )  # fmt: skip
    out_dtype: str | None = setting(
        help="dtype of merged tensors", flag="--out-dtype", default_text="the base tensor's dtype",
        yaml_key="out_dtype", identity="out_dtype",
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class HowToRun:
    """The settings that never change a byte: where and how the job runs, and what it may do."""

    out: str | None = setting(
        help="output folder (or give it after CONFIG)", flag="--out", metavar="PATH",
        default_text="required for `merge`", commands=("merge", "plan"), api_type=PathLike,
    )  # fmt: skip
    overwrite: bool = setting(
        False, help="write into an output folder that holds files", flag="--overwrite",
        commands=("merge",),
    )  # fmt: skip
    output_shared: bool = setting(
        False, help="the local output folder is mounted on every node: workers write their "
        "parts there (else only on a one-node cluster; elsewhere the driver writes)",
        flag="--output-shared", commands=("merge", "plan"),
    )  # fmt: skip
    storage_options: dict[str, dict[str, Any]] = setting(
        factory=dict, help='fsspec options per protocol, e.g. \'{"s3": {"endpoint_url": '
        '"http://..."}}\'', flag="--storage-options", metavar="JSON", convert=_storage_options,
        default_text="none", yaml_key="storage_options",
        api_type=Mapping[str, Mapping[str, Any]],
    )  # fmt: skip
    integers_from_base: bool = setting(
        False, help="copy the base's integer and bool tensors even where a task changed them "
        "(they cannot be merged; without it such a task is refused)",
        flag="--integers-from-base",
    )  # fmt: skip
    drop_extra_tensors: bool = setting(
        False, help="leave out the tensors a task holds that the base does not (a value head; "
        "an lm_head the base ties to its embeddings) instead of refusing the task; the report "
        "and the model card list them", flag="--drop-extra-tensors",
    )  # fmt: skip
    allow_nonfinite: bool = setting(
        False, help="merge inputs that hold NaN or Inf instead of refusing them (this also "
        "skips the check of base values that overflow a task's dtype, and the precision "
        "check's counts and warnings)",
        flag="--allow-nonfinite",
    )  # fmt: skip
    unit_budget_bytes: int | None = setting(
        help="input MiB one work unit may read, per input (it sets how finely work is spread, "
        "not the read buffers)", flag="--unit-mb", parse=float, convert=_mib,
        default_text=f"from the cluster: {UNITS_PER_SLOT} units per core over the largest "
        f"input, at most {Fraction(MEMORY_SHARE)} of a core's memory, "
        f"{MIN_UNIT_BUDGET // 2**20} to {MAX_UNIT_BUDGET // 2**20}",
    )  # fmt: skip
    workers: int | None = setting(
        help="CPU tasks running at once (GPU workers: one per GPU)", flag="--workers",
        parse=int, default_text="the CPUs the GPU workers leave: one unit per core runs, as "
        "many again wait queued",
    )  # fmt: skip
    device: str = setting(
        "auto", help="auto: every CPU with the fused kernels; the units of tensors that need "
        "the eager rule (TIES's and breadcrumbs' L1 rescaling, float64) or have LoRA "
        "products to compute on one worker per GPU, where the cluster has GPUs; cpu: every "
        "unit on the CPUs; cuda: every unit on the GPU workers, or refuse to start without "
        "GPUs", flag="--device",
        choices=DEVICES, yaml_key="device",
    )  # fmt: skip
    address: str | None = setting(
        help="the Ray cluster to run on", flag="--address",
        default_text="`RAY_ADDRESS`, else a local Ray",
    )  # fmt: skip
    kernels: str = setting(
        "auto", help="auto: fused CPU kernels where they apply (the same bytes); eager: plain "
        "torch", flag="--kernels", choices=KERNELS,
    )  # fmt: skip
    input_cache: str = setting(
        "auto", help="keep what the first pass fetched on each node's disk, so later passes "
        "read it there: auto (inputs not on a local filesystem), on (every input), off",
        flag="--input-cache", choices=INPUT_CACHES,
    )  # fmt: skip
    cache_dir: str | None = setting(
        help="node-local folder for --input-cache", flag="--cache-dir", metavar="DIR",
        default_text="a private folder in each node's temp dir", api_type=PathLike,
    )  # fmt: skip
    log_format: str = setting(
        "text", help="text: a progress bar on a terminal; json: one JSON object per line on "
        "stderr", flag="--log-format", choices=LOG_FORMATS,
    )  # fmt: skip


def parse_grid(given: Sequence[str] | Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """`--grid NAME=V1,V2` flags (or the API's mapping of a name to its values) as a
    mapping of each name to its values, as given (text from the command line: each method
    reads it as its parameter's kind, `planning.sweep`)."""
    if isinstance(given, Mapping):
        out = {}
        for name, values in given.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                values = (values,)
            out[str(name)] = tuple(values)
    else:
        out = {}
        for item in given:
            name, eq, values = item.partition("=")
            name = name.strip()
            if not eq or not name or not values.strip():
                raise RamDistError(f"--grid takes NAME=V1,V2,...; got {item!r}")
            if name in out:
                raise RamDistError(f"--grid {name} given twice: give its values once")
            out[name] = tuple(v.strip() for v in values.split(","))
    for name, values in out.items():
        if not values or any(isinstance(v, str) and not v for v in values):
            raise RamDistError(f"grid {name}: give one or more values, e.g. {name}=0.1,0.2")
        if len(set(map(repr, values))) != len(values):
            raise RamDistError(f"grid {name}: a value is given twice ({list(values)})")
    return out


@dataclass(frozen=True, kw_only=True)
class SweepOver:
    """A sweep: several merges of the same inputs, made from the reads of one
    (`docs/sweeps.md`). Each variant is a job of its own (its identity: its method and
    parameters); these settings say which variants there are."""

    methods: tuple[str, ...] = setting(
        (), help="a sweep's methods: one output folder per method and grid point (give "
        "--method more than once)", default_text="the method alone: no sweep",
        commands=("merge", "plan"), api_type=Sequence[str],
    )  # fmt: skip
    grid: dict[str, tuple[Any, ...]] = setting(
        factory=dict, help="a sweep's grid: every combination of the values of the names "
        "each method takes, one variant each (repeat per name)", flag="--grid",
        metavar="NAME=V1,V2", repeat=True, convert=parse_grid, default_text="none",
        commands=("merge", "plan"), api_type=Mapping[str, Sequence[Any]],
    )  # fmt: skip


@dataclass(frozen=True)
class Declared:
    """One setting as the generators read it: its field's name, type, default and `Setting`."""

    name: str
    type: Any
    default: Any
    """The field's default (a factory's value); `REQUIRED` for base and tasks."""
    meta: Setting

    @property
    def shown_default(self) -> str:
        """The default in words: `docs/cli.md`'s table and `--help` show the same."""
        if self.meta.default_text:
            return self.meta.default_text
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return f"`{self.default}`"

    def help_text(self) -> str:
        text = self.meta.help() if callable(self.meta.help) else self.meta.help
        first, newline, rest = text.partition("\n")  # `--method`: one line per method after
        return f"{first} (default: {self.shown_default.replace('`', '')}){newline}{rest}"

    def check(self, value: Any) -> None:
        """Refuse a value outside the setting's choices, in the words of its flag."""
        if self.meta.choices and value not in self.meta.choices:
            *first, last = self.meta.choices
            allowed = f"{', '.join(first)} or {last}"
            words = self.name.replace("_", " ")
            raise RamDistError(f"{words} must be {allowed}, got {value!r}")


def _declared(model: type) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(model)
    out = []
    for f in fields(model):
        out.append(Declared(f.name, hints[f.name], _default(f), f.metadata["setting"]))
    return tuple(out)


def _default(f: Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


WHAT = _declared(WhatToMerge)
HOW = _declared(HowToRun)
SWEEP = _declared(SweepOver)
SETTINGS = WHAT + HOW + SWEEP
"""Every setting, what to merge first, a sweep's last."""
BY_NAME = {s.name: s for s in SETTINGS}
#: The mergekit YAML keys that set a setting, with its name.
YAML_KEYS = {s.meta.yaml_key: s.name for s in SETTINGS if s.meta.yaml_key}
#: The keys of the job's identity, as the what-to-merge settings name them.
IDENTITY_KEYS = frozenset(s.meta.identity for s in WHAT if s.meta.identity)


def flagged(command: str) -> tuple[Declared, ...]:
    """The settings `command` takes a flag for, in declaration order."""
    return tuple(s for s in SETTINGS if s.meta.flag and command in s.meta.commands)


def api_settings(command: str | None) -> tuple[Declared, ...]:
    """The settings an API call takes as keywords: every one (None: `job_config`), or those
    of `command`'s settings the command can use (`probe` takes no output settings)."""
    if command != "probe":
        return SETTINGS
    return tuple(s for s in SETTINGS if command in s.meta.commands)


def check_choices(values: Mapping[str, Any]) -> None:
    """Refuse a value outside its setting's choices."""
    for s in SETTINGS:
        if s.name in values:
            s.check(values[s.name])
