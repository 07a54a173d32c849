"""How a merge method declares its parameters, the parameters methods share, and the checks
of their values.

Each method declares what it takes (`MergeMethod.parameters`, a tuple of `Parameter`): each
parameter's name (mergekit's key under `parameters:`, and the name in the report and in
`mergekit_config.yml`), its default, whether it is set per task (mergekit's per-model
parameters) or once, how a YAML value is read, the CLI flag and its help. A flag has one
meaning: where methods give one name different meanings (RAM's `epsilon`, a threshold, and
DELLA's, a half-width), each meaning has a flag of its own (`--eps`, `--della-epsilon`), while
the YAML key stays mergekit's name. `PARAMETERS[method]`
collects them from `ram_dist.methods.METHODS`; the YAML reader and writer
(`ram_dist.mergekit_config`), the resolution per tensor (`planning.tensor_params`), the CLI
flags and the model card all read it from there.

Pure Python, no torch (the method modules import it only where they compute): `ram-dist
--help` builds its flags from this table.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ram_dist.errors import RamDistError

#: A check of one value beyond its kind: raises `RamDistError` starting with `where`.
Check = Callable[[Any, str], None]


@dataclass(frozen=True)
class Parameter:
    """One parameter of one method."""

    name: str
    """mergekit's key in `parameters:`; also the name in reports and `mergekit_config.yml`."""
    default: Any
    """What a tensor gets when no setting gives it a value (None: none, it is required)."""
    help: str
    """What it does, for `--help` and the model card."""
    kind: type = float
    """How a value is read and checked: float (finite), bool, int, or str (one of `choices`)."""
    per_task: bool = False
    """Set per task (mergekit's per-model `parameters`, resolved as a list in task order), or
    once for the whole merge (read from the top-level `parameters` only)."""
    cli_flag: str | None = None
    """The command-line flag that sets it (a per-task flag is given once, or once per task);
    None: YAML only. One flag, one meaning: a method that gives the name another meaning
    declares it with a flag named after the method (`--della-epsilon`, `--nearswap-t`)."""
    choices: tuple[str, ...] = ()
    """The values a str parameter may take."""
    check: Check | None = None
    """A check beyond the kind (a range)."""
    effect: bool = True
    """False: mergekit's method declares it, but it changes nothing here; a YAML value is
    accepted with a note and dropped."""
    passed: bool = True
    """Resolved per tensor and handed to the method (and so reported and written to
    `mergekit_config.yml`); False only for a parameter without effect that the method never
    reads."""

    @property
    def cli_dest(self) -> str | None:
        """The attribute argparse stores the flag's value in (`--lambda`: `lambda_`)."""
        if self.cli_flag is None:
            return None
        dest = self.cli_flag.lstrip("-").replace("-", "_")
        return dest + "_" if keyword.iskeyword(dest) else dest

    def validate(self, value: Any, where: str) -> None:
        """Raise `RamDistError` (`where: parameter NAME ...`) unless `value` is a valid value.
        A parameter whose default is None must be given (mergekit's `t` of slerp and nearswap)."""
        if value is None and self.default is None:
            how = f"{self.cli_flag} VALUE, or " if self.cli_flag else ""
            raise RamDistError(
                f"{where}: parameter {self.name} is required: give it ({how}"
                f"parameters: {{{self.name}: VALUE}} in a config)"
            )
        if self.kind is float:
            number(value, self.name, where)
        elif self.kind is bool:
            flag(value, self.name, where)
        elif self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise RamDistError(f"{where}: parameter {self.name} must be an integer")
        elif value not in self.choices:
            allowed = " or ".join(repr(c) for c in self.choices)
            raise RamDistError(f"{where}: parameter {self.name} must be {allowed}, got {value!r}")
        if self.check is not None:
            self.check(value, where)


def number(value: Any, name: str, where: str) -> float:
    """A real number parameter, or an error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RamDistError(f"{where}: parameter {name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise RamDistError(f"{where}: parameter {name} must be finite, got {value!r}")
    return float(value)


def flag(value: Any, name: str, where: str) -> bool:
    """A true/false parameter, or an error naming it."""
    if not isinstance(value, bool):
        raise RamDistError(f"{where}: parameter {name} must be true or false, got {value!r}")
    return value


def _at_least_zero(name: str) -> Check:
    def check(value: Any, where: str) -> None:
        if float(value) < 0:
            raise RamDistError(f"{where}: parameter {name} must be >= 0, got {float(value)}")

    return check


def _density(value: Any, where: str) -> None:
    if not 0 < value <= 1:
        raise RamDistError(f"{where}: parameter density must be in (0, 1], got {value}")


def _gamma(value: Any, where: str) -> None:
    if not 0 <= float(value) <= 1:
        raise RamDistError(f"{where}: parameter gamma must be in [0, 1], got {float(value)}")


def _epsilon(value: Any, where: str) -> None:
    if float(value) <= 0:
        raise RamDistError(f"{where}: parameter epsilon (eps) must be > 0, got {float(value)}")


# ---------------------------------------------------------------------------------------------
# Each parameter once; a method takes it with its own default (`_with`).

R = Parameter(
    "r", 0.1, "RAM+ rescaling strength of a task's unique updates", cli_flag="--r",
    check=_at_least_zero("r"),
)  # fmt: skip
ALPHA = Parameter(
    "alpha", 2.0, "RAM+ cap on rho, the ratio of shared to unique changes", cli_flag="--alpha",
    check=_at_least_zero("alpha"),
)  # fmt: skip
EPSILON = Parameter(
    "epsilon", 1e-5, "a task changed an element where abs(tau) > epsilon", cli_flag="--eps",
    check=_epsilon,
)  # fmt: skip
DELLA_EPSILON = Parameter(
    "epsilon", 0.15, "half-width of della's keep probabilities around the density, by rank",
    per_task=True, cli_flag="--della-epsilon", check=_at_least_zero("epsilon"),
)  # fmt: skip
SCOPE = Parameter(
    "scope", "model", "where rho and lambda are counted: the whole model, or each tensor",
    kind=str, choices=("model", "tensor"),
)  # fmt: skip
WEIGHT = Parameter(
    "weight", 1.0, "weight of each task", per_task=True, cli_flag="--weight"
)  # fmt: skip
DENSITY = Parameter(
    "density", 1.0, "share of each task vector kept", per_task=True, cli_flag="--density",
    check=_density,
)  # fmt: skip
GAMMA = Parameter(
    "gamma", 0.01, "share of the largest magnitudes of each task vector dropped as outliers",
    per_task=True, cli_flag="--gamma", check=_gamma,
)  # fmt: skip
NORMALIZE = Parameter(
    "normalize", False, "divide by the sum of the weights", kind=bool, cli_flag="--normalize"
)  # fmt: skip
LAMBDA = Parameter("lambda", 1.0, "scale of the merged task vector", cli_flag="--lambda")
RESCALE = Parameter(
    "rescale", False, "rescale each sparsified task vector to its L1 norm", kind=bool,
    cli_flag="--rescale",
)  # fmt: skip
SEED = Parameter("seed", 0, "seed of the random masks", kind=int, cli_flag="--seed")
K = Parameter(
    "k", 1, "TALL masks: the least number of tasks an element must matter to, to be kept",
    kind=int, per_task=True, cli_flag="--k", check=_at_least_zero("k"),
)  # fmt: skip
TALL_LAMBDA = Parameter(
    "lambda", 1.0, "TALL masks: a task's element matters where abs(delta) > lambda * "
    "abs(merged - delta)", per_task=True, cli_flag="--consensus-lambda",
    check=_at_least_zero("lambda"),
)  # fmt: skip
INT8_MASK = Parameter(
    "int8_mask", False, "mergekit's dtype of the sign mask (no effect on the result)",
    kind=bool, effect=False, passed=False,
)  # fmt: skip


def variant(parameter: Parameter, default: Any = None, **changes: Any) -> Parameter:
    """`parameter` as one method takes it (its default, unless None)."""
    if default is not None:
        changes["default"] = default
    return replace(parameter, **changes)


def handed(parameters: tuple[Parameter, ...]) -> tuple[Parameter, ...]:
    """The parameters a method is handed per tensor (`passed`), globals first: the order of
    `TensorParams`, of the report and of `mergekit_config.yml`."""
    params = [p for p in parameters if p.passed]
    return tuple(p for p in params if not p.per_task) + tuple(p for p in params if p.per_task)


def _by_name(table: Mapping[str, tuple[Parameter, ...]]) -> dict[str, Parameter]:
    out: dict[str, Parameter] = {}
    for params in table.values():
        for p in params:
            out.setdefault(p.name, p)
    return out


def __getattr__(name: str) -> Any:
    """`PARAMETERS`, every method's parameters by method name (each method declares its own:
    `ram_dist.methods.METHODS`), and `BY_NAME`, every parameter name any method takes with
    its first declaration (its kind, flag and help are the same in every method;
    `check_table`)."""
    if name not in ("PARAMETERS", "BY_NAME"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ram_dist.methods import METHODS

    table = {method_name: m.parameters for method_name, m in METHODS.items()}
    return table if name == "PARAMETERS" else _by_name(table)


def cli_parameters() -> list[tuple[Parameter, str]]:
    """One parameter per flag, in table order, each with its help: what it does, and which
    methods take it, with their defaults (`check_table`: a flag means one thing)."""
    from ram_dist.methods.parameters import PARAMETERS

    by_flag: dict[str, list[tuple[str, Parameter]]] = {}
    for method, params in PARAMETERS.items():
        for q in params:
            if q.cli_flag is not None:
                by_flag.setdefault(q.cli_flag, []).append((method, q))
    out = []
    for declared in by_flag.values():
        p = declared[0][1]
        defaults: dict[str, list[str]] = {}
        for method, q in declared:
            if q.effect:
                defaults.setdefault(_shown(q.default), []).append(method)
        uses = "; ".join(f"{', '.join(ms)}: default {d}" for d, ms in defaults.items())
        given = ", once for all tasks or once per --task, in order" if p.per_task else ""
        out.append((p, f"{p.help}{given} ({uses})"))
    return out


def check_flag(flag: str, name: str, method: str) -> None:
    """Refuse `flag` (which sets parameter `name`) for `method` where `method` gives `name`
    another meaning, set by a flag of its own: `--eps` is RAM's threshold, never DELLA's
    half-width (`--della-epsilon`)."""
    from ram_dist.methods.parameters import PARAMETERS

    own = next((q for q in PARAMETERS.get(method, ()) if q.name == name), None)
    if own is None or own.cli_flag in (None, flag):
        return
    owners = [m for m, params in PARAMETERS.items() for q in params if q.cli_flag == flag]
    raise RamDistError(
        f"{flag} sets {name} for {', '.join(owners)}; {method}'s {name} ({own.help}) is "
        f"{own.cli_flag}"
    )


def _shown(value: Any) -> str:
    if value is None:
        return "required"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def check_table(table: Mapping[str, tuple[Parameter, ...]]) -> None:
    """A name is read the same way in every method (its kind, its choices); its scope,
    default, help and checks are each method's own (DELLA's `epsilon` is per task, RAM's is
    one value). A flag sets one name with one meaning: the same help and scope wherever it
    is declared, so that `--help` says one thing of it."""
    by_name = _by_name(table)
    flags: dict[str, Parameter] = {}
    for method, params in table.items():
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"{method} declares a parameter twice: {names}")
        for p in params:
            q = by_name[p.name]
            if (p.kind, p.choices) != (q.kind, q.choices):
                raise ValueError(
                    f"parameter {p.name} of {method} is read differently from its first "
                    "declaration (kind or choices)"
                )
            if p.effect and not p.passed:
                raise ValueError(f"{method}: {p.name} has an effect, so it must be passed")
            if p.cli_flag is None:
                continue
            first = flags.setdefault(p.cli_flag, p)
            if first.name != p.name:
                raise ValueError(f"flag {p.cli_flag} sets both {first.name} and {p.name}")
            if (first.help, first.per_task) != (p.help, p.per_task):
                raise ValueError(
                    f"flag {p.cli_flag} means two things ({method}'s {p.name}: {p.help!r}): "
                    f"give {method}'s a flag of its own (--{method}-{p.name})"
                )
