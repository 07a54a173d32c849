"""What docs/ says of the base at a task's precision, where it quotes the code: the warning's
threshold (`report.rounding.WARN_SHARE`), the warning's words, the overflow refusal's words,
the `measured_against` sentence and the text report's heading above those sentences."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ram_dist.engine.passes import _overflow_error
from ram_dist.planning.precision import measured_against
from ram_dist.planning.sources import Fp8Source, Source
from ram_dist.report.rounding import WARN_SHARE, precision_lines, warning

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = ROOT / "docs"


def _text(page: str) -> str:
    """A docs page with its line breaks and indentation as single spaces."""
    return " ".join((DOCS / page).read_text(encoding="utf-8").split())


def _row(page: str, start: str) -> str:
    """The one table row of `page` whose first cell starts with `start`."""
    rows = [
        line
        for line in (DOCS / page).read_text(encoding="utf-8").splitlines()
        if line.startswith(f"| `{start}")
    ]
    assert len(rows) == 1, (page, start, rows)
    return rows[0]


def _quote(row: str) -> str:
    """The code span of a table row's first cell."""
    return row.split("`")[1]


def _matches(quote: str, message: str) -> bool:
    """Whether `message` reads as `quote` says: each `...` stands for any text, and `N` for
    a number."""
    pattern = re.escape(quote).replace(re.escape("..."), ".*?")
    pattern = re.sub(r"\bN\b", r"\\d+", pattern)
    return re.fullmatch(pattern, message, re.S) is not None


def test_the_threshold_the_docs_state_is_warn_share() -> None:
    row = _row("troubleshooting.md", "warning: task")
    found = [
        re.search(r"more than (\d+)% of the elements the task changed", row),
        re.search(r"Where a task's share is above (\d+)%", _text("exactness.md")),
        re.search(r"Where more than (\d+)% of the elements a task changed", _text("inputs.md")),
    ]
    assert all(found), found
    assert [int(m.group(1)) / 100 for m in found] == [WARN_SHARE] * len(found)
    said = re.search(r"\| `warn_share` \| [^|]*: ([\d.]+) \|", _text("observability.md"))
    assert said is not None and float(said.group(1)) == WARN_SHARE


def test_the_warning_quoted_is_the_code_s() -> None:
    quote = _quote(_row("troubleshooting.md", "warning: task"))
    assert _matches(quote, warning(1, "URL", 12345, 0.93))
    assert not _matches(quote, warning(2, "URL", 12345, 0.93))
    said = re.search(r"Each warning starts `([^`]+)`", _text("observability.md"))
    assert said is not None and _matches(said.group(1), warning(7, "MODEL", 5, 0.5))


def test_the_overflow_refusal_quoted_is_the_code_s() -> None:
    tasks = [
        SimpleNamespace(describe=lambda name: "task 1 (OTHER), file G"),
        SimpleNamespace(describe=lambda name: "task 2 (URL), file F"),
    ]
    sources = [SimpleNamespace(values_dtype=d) for d in ("F32", "F32", "F16")]
    layout = SimpleNamespace(tensors={"x": SimpleNamespace(sources=sources)})
    job = SimpleNamespace(tasks=tasks, layout=layout)
    message = str(_overflow_error(job, {"x": [0, 1]}))
    quotes = [_quote(_row("troubleshooting.md", "a task's update cannot be measured"))]
    shown = (DOCS / "exactness.md").read_text(encoding="utf-8").splitlines()
    quotes += [
        line.removeprefix("ram-dist: error: ")
        for line in shown
        if line.startswith("ram-dist: error: a task's update")
    ]
    assert len(quotes) == 2, quotes
    for quote in quotes:
        assert _matches(quote, message), (quote, message)


def test_the_measured_against_sentence_quoted_is_the_code_s() -> None:
    fp8 = Fp8Source("base", 0, "F8_E4M3", "base", 0, "F32", (128, 128), 128)
    sources = [fp8, Source("t1", 0, "F32"), Source("t2", 0, "BF16")]
    entry = SimpleNamespace(participating=True, scale_of=None, sources=sources)
    layout = SimpleNamespace(tensors={f"w{i}": entry for i in range(12)})
    (expected,) = measured_against(layout, ["task 1", "task 2"])
    sentence = re.compile(r"`(task \d+: [^`]*, measured against the [^`]*)`")
    pages = ("fp8.md", "inputs.md", "observability.md")
    quoted = [q for page in pages for q in sentence.findall(_text(page))]
    assert len(quoted) >= 3 and set(quoted) == {expected}, quoted
    heading = re.search(r"under `(measured against the base at [^`]+)`", _text("observability.md"))
    assert heading is not None
    assert precision_lines({"formats": {"measured_against": [expected]}})[0] == heading.group(1)
