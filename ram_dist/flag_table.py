"""The tables made from the declarations: docs/cli.md's flag table (each job setting,
`ram_dist.settings`, and each method parameter that has a flag, `methods.parameters`) and
README.md's table of methods (each method's `summary`).

`python -m ram_dist.flag_table` (from a checkout) rewrites each table between its two marker
comments in place; a test fails while a file differs from what its `render` makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ram_dist import settings
from ram_dist.methods import METHODS
from ram_dist.methods.parameters import cli_parameters

BEGIN = "<!-- flag-table: made by `python -m ram_dist.flag_table`; edit the declarations -->"
END = "<!-- /flag-table -->"
#: The file the table lives in, in a checkout.
CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
METHODS_BEGIN = "<!-- method-table: made by `python -m ram_dist.flag_table`; edit the methods -->"
METHODS_END = "<!-- /method-table -->"
README = CLI_DOC.parents[1] / "README.md"


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
    """README's table: one row per method, in the registry's order, the default marked."""
    default = settings.BY_NAME["method"].default
    rows = ["| `--method` | what it does |", "|---|---|"]
    for name, method in METHODS.items():
        shown = f"`{name}` (default)" if name == default else f"`{name}`"
        rows.append(f"| {shown} | {_cell(method.summary)} |")
    return "\n".join(rows) + "\n"


#: Each table: its file, its markers and what makes it.
TABLES = ((CLI_DOC, BEGIN, END, render), (README, METHODS_BEGIN, METHODS_END, render_methods))


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
