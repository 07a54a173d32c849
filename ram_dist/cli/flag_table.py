"""The tables made from the declarations: docs/cli.md's flag table (each job setting,
`ram_dist.settings`, and each method parameter that has a flag, `methods.parameters`),
README.md's table of methods (each method's `summary`), docs/methods.md's table of parameter
defaults (each method's `parameters`) and of fused kernels (what each method offers the
engine's fused path), docs/output.md's table of leases (`io.backends.BACKENDS`) and
docs/mergekit-methods.md's tables of the sparsifying methods' parameters.

`python -m ram_dist.cli.flag_table` (from a checkout) rewrites each table between its two marker
comments in place; a test fails while a file differs from what its `render` makes.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

from ram_dist import settings
from ram_dist.methods import METHODS
from ram_dist.methods.parameters import cli_parameters

MADE_BY = "made by `python -m ram_dist.cli.flag_table`"
BEGIN = f"<!-- flag-table: {MADE_BY}; edit the declarations -->"
END = "<!-- /flag-table -->"
#: The file the table lives in, in a checkout.
CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
METHODS_BEGIN = f"<!-- method-table: {MADE_BY}; edit the methods -->"
METHODS_END = "<!-- /method-table -->"
README = CLI_DOC.parents[1] / "README.md"
METHODS_DOC = CLI_DOC.parent / "methods.md"
PARAMETERS_BEGIN = (
    "<!-- parameter-table: made by `python -m ram_dist.cli.flag_table`; edit the methods -->"
)
PARAMETERS_END = "<!-- /parameter-table -->"
KERNELS_BEGIN = f"<!-- kernel-table: {MADE_BY}; edit the methods -->"
KERNELS_END = "<!-- /kernel-table -->"
OUTPUT_DOC = CLI_DOC.parent / "output.md"
LEASES_BEGIN = "<!-- lease-table: made by `python -m ram_dist.cli.flag_table`; edit io.backends -->"
LEASES_END = "<!-- /lease-table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _metavar(flag: str, metavar: str | None) -> str:
    return metavar or flag.lstrip("-").replace("-", "_").upper()


def render() -> str:
    """The table: one row per flag, in `--help`'s order (a method's parameters after
    `--method`)."""
    rows = ["| flag | commands | default | what it sets |", "|---|---|---|---|"]
    for s in settings.SETTINGS:
        if not s.meta.flag:
            continue
        flag = s.meta.flag
        if s.type is not bool:
            flag += " " + ("{" + ",".join(s.meta.choices) + "}" if s.meta.choices
                           else _metavar(flag, s.meta.metavar))  # fmt: skip
        text = s.meta.help() if callable(s.meta.help) else s.meta.help
        text = text.split("\n", 1)[0]  # `--method`: its methods are the table below
        commands = ", ".join(c for c in settings.COMMANDS if c in s.meta.commands)
        rows.append(f"| `{flag}` | {commands} | {_cell(s.shown_default)} | {_cell(text)} |")
        if s.name == "method":
            for p, text in cli_parameters():
                if p.kind is bool:
                    flag = "--[no-]" + p.cli_flag.removeprefix("--")
                else:
                    flag = f"{p.cli_flag} {_metavar(p.cli_flag, None)}"
                commands = ", ".join(settings.COMMANDS)
                rows.append(f"| `{flag}` | {commands} | by method | {_cell(text)} |")
    return "\n".join(rows) + "\n"


def render_methods() -> str:
    """README's and docs/cli.md's table: one row per method, in the registry's order, the
    default marked."""
    default = settings.BY_NAME["method"].default
    rows = ["| `--method` | what it does |", "|---|---|"]
    for name, method in METHODS.items():
        shown = f"`{name}` (default)" if name == default else f"`{name}`"
        rows.append(f"| {shown} | {_cell(method.summary)} |")
    return "\n".join(rows) + "\n"


def _shown(value: Any) -> str:
    if value is None:
        return "required"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _grouped(pairs: list[tuple[str, str]]) -> str:
    """`a`, `b`: X; `c`: Y: methods grouped by what they say, in the registry's order."""
    groups: dict[str, list[str]] = {}
    for method, said in pairs:
        groups.setdefault(said, []).append(f"`{method}`")
    return "; ".join(f"{', '.join(ms)}: {said}" for said, ms in groups.items())


def render_parameters() -> str:
    """docs/methods.md's table: one row per parameter name, flag and scope (once or per
    task), with each method that takes it and its default there; parameters without effect
    (mergekit's `int8_mask`) left out."""
    rows: dict[tuple[str, bool, str | None], list[tuple[str, str]]] = {}
    for name, method in METHODS.items():
        for p in method.parameters:
            if p.effect:
                rows.setdefault((p.name, p.per_task, p.cli_flag), []).append(
                    (name, _shown(p.default))
                )
    out = ["| parameter (YAML key) | flag | set | methods: default |", "|---|---|---|---|"]
    for (name, per_task, cli_flag), uses in rows.items():
        kind = next(p.kind for p in METHODS[uses[0][0]].parameters if p.name == name)
        if cli_flag is None:
            flag = "none (YAML only)"
        elif kind is bool:
            flag = "`--[no-]" + cli_flag.removeprefix("--") + "`"
        else:
            flag = f"`{cli_flag}`"
        scope = "per task" if per_task else "once"
        out.append(f"| `{name}` | {flag} | {scope} | {_grouped(uses)} |")
    return "\n".join(out) + "\n"


def default_params(method: Any, n_tasks: int = 2) -> dict[str, Any]:
    """A tensor's parameters at the method's defaults (a required one at 0.5)."""
    out: dict[str, Any] = {}
    for p in method.parameters:
        value = 0.5 if p.default is None else p.default
        out[p.name] = [value] * n_tasks if p.per_task else value
    return out


def _offers(method: Any, member: str) -> bool:
    """Whether the method's class gives `member` itself (not `protocol.Eager`'s)."""
    from ram_dist.methods.protocol import Eager

    return getattr(type(method), member) is not getattr(Eager, member)


def kernel_cells(method: Any) -> tuple[str, str, str, str]:
    """What the fused path runs of a method: its reduce rounds (how many at most, and on
    what: whether it gives `fused_statistics`), its map pass at the defaults, how a
    quantized input reaches its kernels (`reads_stored`, `writes_fp8`; "decoded" where no
    kernel runs), and when the map pass's kernels take a tensor (`fuses`' docstring)."""
    how = "fused kernels" if _offers(method, "fused_statistics") else "the eager rule"
    rounds = f"at most {method.rounds}, on {how}" if method.rounds else "the input check only"
    fused = _offers(method, "fused_merge") and method.fuses(default_params(method))
    when = ""
    if _offers(method, "fuses"):
        when = " ".join(inspect.getdoc(type(method).fuses).split())
    quantized = "decoded"
    if getattr(method, "reads_stored", False) and (fused or "fused" in rounds):
        quantized = "as stored" + ("; FP8 written in one sweep" if method.writes_fp8 else "")
    return rounds, "fused kernels" if fused else "the eager rule", quantized, when


def render_kernels() -> str:
    """docs/methods.md's table of fused kernels: one row per run of methods (in the
    registry's order) that say the same."""
    out = [
        "| method | reduce rounds | map pass, at the defaults | quantized inputs, in the kernels "
        "| the map pass's kernels |",
        "|---|---|---|---|---|",
    ]
    rows: list[tuple[list[str], tuple[str, str, str, str]]] = []
    for name, method in METHODS.items():
        cells = kernel_cells(method)
        if rows and rows[-1][1] == cells:
            rows[-1][0].append(name)
        else:
            rows.append(([name], cells))
    for names, (rounds, map_pass, quantized, when) in rows:
        shown = ", ".join(f"`{n}`" for n in names)
        cells = f"{rounds} | {map_pass} | {quantized} | {_cell(when) or 'none'}"
        out.append(f"| {shown} | {cells} |")
    return "\n".join(out) + "\n"


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    found = re.search(r"\.(\s+(?=[A-Z])|$)", text)
    return text[: found.start() + 1] if found else text


def lease_rows() -> list[tuple[list[str], str, str]]:
    """Each lease class of `io.backends`, in the table's order: the protocols that use it
    (the last, the default, also every protocol not listed), its `module:Class`, and how it
    makes the claim exclusive (its module's first sentence, after the store's name)."""
    import importlib

    from ram_dist.io.backends import ALIASES, BACKENDS, DEFAULT

    by_lease: dict[str, list[str]] = {}
    for protocol, b in BACKENDS.items():
        by_lease.setdefault(b.lease, []).append(protocol)
    for alias, protocol in ALIASES.items():
        by_lease[BACKENDS[protocol].lease].append(alias)
    by_lease.setdefault(DEFAULT.lease, [])
    by_lease[DEFAULT.lease] = by_lease.pop(DEFAULT.lease)  # the default last
    rows = []
    for lease, protocols in by_lease.items():
        doc = importlib.import_module(lease.partition(":")[0]).__doc__ or ""
        how = _first_sentence(doc).partition(": ")[2]
        rows.append((protocols, lease, how[:1].upper() + how[1:]))
    return rows


def render_leases() -> str:
    """docs/output.md's table: how each kind of store makes the lease exclusive."""
    from ram_dist.io.backends import DEFAULT

    out = ["| protocols | how the lease is created | class |", "|---|---|---|"]
    for protocols, lease, how in lease_rows():
        shown = ", ".join(f"`{p}://`" for p in protocols)
        if lease == DEFAULT.lease:
            shown += ", any other fsspec protocol"
        if "file" in protocols:
            shown += ", a plain path"
        out.append(f"| {shown} | {_cell(how)} | `{lease.replace(':', '.')}` |")
    return "\n".join(out) + "\n"


MERGEKIT_DOC = CLI_DOC.parent / "mergekit-methods.md"


def method_begin(name: str) -> str:
    return f"<!-- parameters of {name}: {MADE_BY}; edit the methods -->"


def method_end(name: str) -> str:
    return f"<!-- /parameters of {name} -->"


def render_method_parameters(names: tuple[str, ...]) -> Any:
    """docs/mergekit-methods.md's table of the parameters of a family of methods (declared
    alike but for their defaults): each with its flag, its scope (mergekit's per-model
    parameters, or one global value), its default in each method and its help."""

    def make() -> str:
        out = ["| parameter | flag | scope | default | what it does |", "|---|---|---|---|---|"]
        for p in METHODS[names[0]].parameters:
            flag = "none (YAML only)" if p.cli_flag is None else f"`{p.cli_flag}`"
            if p.cli_flag is not None and p.kind is bool:
                flag = "`--[no-]" + p.cli_flag.removeprefix("--") + "`"
            scope = "per model" if p.per_task else "global"
            each = [(n, q) for n in names for q in METHODS[n].parameters if q.name == p.name]
            shown = [(n, _shown(q.default) if q.effect else "accepted, no effect") for n, q in each]
            default = shown[0][1] if len({d for _, d in shown}) == 1 else _grouped(shown)
            out.append(f"| `{p.name}` | {flag} | {scope} | {default} | {_cell(p.help)} |")
        return "\n".join(out) + "\n"

    return make


#: The families whose parameters docs/mergekit-methods.md shows in a generated table.
MERGEKIT_TABLES = (
    ("breadcrumbs", "breadcrumbs_ties"),
    ("della", "della_linear"),
    ("consensus_ta", "consensus_ties"),
)

#: Each table: its file, its markers and what makes it.
TABLES = (
    (CLI_DOC, BEGIN, END, render),
    (README, METHODS_BEGIN, METHODS_END, render_methods),
    (CLI_DOC, METHODS_BEGIN, METHODS_END, render_methods),
    (METHODS_DOC, PARAMETERS_BEGIN, PARAMETERS_END, render_parameters),
    (METHODS_DOC, KERNELS_BEGIN, KERNELS_END, render_kernels),
    (OUTPUT_DOC, LEASES_BEGIN, LEASES_END, render_leases),
    *(
        (MERGEKIT_DOC, method_begin(f[0]), method_end(f[0]), render_method_parameters(f))
        for f in MERGEKIT_TABLES
    ),
)


def rewrite(text: str, begin: str = BEGIN, end: str = END, make=render) -> str:  # noqa: ANN001
    """`text` with the table between the markers made anew."""
    head, found, rest = text.partition(begin + "\n")
    old, found_end, tail = rest.partition(end)
    if not (found and found_end):
        raise ValueError(f"no {begin} ... {end} block")
    return head + begin + "\n" + make() + end + tail


def main() -> int:
    for path, begin, end, make in TABLES:
        text = path.read_text()
        new = rewrite(text, begin, end, make)
        if new != text:
            path.write_text(new)
            print(f"{path}: table rewritten")
        else:
            print(f"{path}: table up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
