"""The flag table of docs/cli.md, made from the declarations: each job setting
(`ram_dist.settings`) and each method parameter that has a flag (`methods.parameters`).

`python -m ram_dist.flag_table` (from a checkout) rewrites the table between the two marker
comments of docs/cli.md in place; a test fails while the file differs from `render()`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ram_dist import settings
from ram_dist.methods.parameters import cli_parameters

BEGIN = "<!-- flag-table: made by `python -m ram_dist.flag_table`; edit the declarations -->"
END = "<!-- /flag-table -->"
#: The file the table lives in, in a checkout.
CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


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


def rewrite(text: str) -> str:
    """`text` with the table between the markers made anew."""
    head, found, rest = text.partition(BEGIN + "\n")
    old, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise ValueError(f"no {BEGIN} ... {END} block")
    return head + BEGIN + "\n" + render() + END + tail


def main() -> int:
    text = CLI_DOC.read_text()
    new = rewrite(text)
    if new != text:
        CLI_DOC.write_text(new)
        print(f"{CLI_DOC}: flag table rewritten")
    else:
        print(f"{CLI_DOC}: flag table up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
