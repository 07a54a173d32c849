"""The benchmark figures of docs/benchmarks.md and README.md are quoted from
benchmarks/RESULTS.md, the dated log: a benchmark's **Latest** paragraph from the newest
entry that runs it (the log is newest first), an **Earlier** one from the entries of the date
it names, and no other paragraph of a benchmark's section holds a measured figure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SUMMARY = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"

DATE = re.compile(r"\d{4}-\d\d-\d\d")
NUMBER = re.compile(r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?=x\b|[^\w.,]|[.,]\D|[.,]?$)")
#: What is no figure: a date, an IP address, a code span.
NOT_FIGURES = re.compile(r"\d{4}-\d\d-\d\d|\d+\.\d+\.\d+\.\d+|`[^`]*`")
#: A measured figure: a decimal, a ratio (`1.2x`), or a number with a unit of time, memory
#: or bytes (`1 GB/s`, a rate of the benchmark's own set-up, is not one).
FIGURE = re.compile(r"\d\.\d|\d+x\b|\d\s?(s|ms|min|h|MiB|GiB|MB|GB)\b(?!/)")


@dataclass(frozen=True)
class Entry:
    title: str
    date: str
    text: str


@cache
def entries() -> tuple[Entry, ...]:
    """RESULTS.md's `## ` entries, newest first, each with its date: the heading's, else
    the first in its text, else the log's own."""
    head, *sections = re.split(r"(?m)^## ", RESULTS.read_text())
    logged = DATE.search(head)
    assert logged is not None
    found = []
    for section in sections:
        title = section.splitlines()[0]
        date = DATE.search(title) or DATE.search(section) or logged
        found.append(Entry(title, date.group(), section))
    return tuple(found)


def latest(benchmark: str) -> Entry:
    """The newest entry that names `benchmark` (as a module or a file)."""
    named = [e for e in entries() if re.search(rf"\b{benchmark}\b", e.text)]
    assert named, f"RESULTS.md has no entry for {benchmark}"
    return named[0]


def figures(text: str) -> list[str]:
    """The numbers of a paragraph, dates and code spans left out."""
    return NUMBER.findall(NOT_FIGURES.sub("", text))


def quotes(number: str, text: str) -> bool:
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", text) is not None


def sections() -> dict[str, list[str]]:
    """docs/benchmarks.md's `### NAME.py` sections: their paragraphs."""
    out = {}
    for part in re.split(r"(?m)^### ", SUMMARY.read_text())[1:]:
        name, _, body = part.partition("\n")
        out[name.removesuffix(".py").strip()] = [p for p in body.split("\n\n") if p.strip()]
    return out


def _unquoted(paragraph: str, text: str) -> list[str]:
    return [n for n in figures(paragraph) if not quotes(n, text)]


def test_every_benchmark_module_has_a_row_and_a_section():
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    benchmarks = {m for m in modules if m.startswith("bench_")} | {"scaling"}
    rows = set(re.findall(r"^\| `(\w+)` \|", SUMMARY.read_text(), re.M))
    assert benchmarks == rows, "docs/benchmarks.md's table of benchmarks differs"
    assert set(sections()) == benchmarks


def test_the_machine_described_is_the_log_s():
    head = RESULTS.read_text().split("\n## ")[0]
    said = re.search(r"development\s+machine: (.*?)\. ", SUMMARY.read_text(), re.S)
    assert said is not None
    assert " ".join(said.group(1).split()) in " ".join(head.split())


@pytest.mark.parametrize("benchmark", sorted(sections()))
def test_each_figure_is_quoted_from_its_entry(benchmark: str):
    paragraphs = sections()[benchmark]
    for paragraph in paragraphs:
        kind = re.match(r"\*\*(Latest|Earlier)\*\* \((\d{4}-\d\d-\d\d)", paragraph)
        if kind is None:
            assert not FIGURE.search(NOT_FIGURES.sub("", paragraph)), (
                f"{benchmark}: a figure outside a **Latest** or **Earlier** paragraph: "
                f"{paragraph!r}"
            )
            continue
        which, date = kind.groups()
        if which == "Latest":
            entry = latest(benchmark)
            assert entry.date == date, (benchmark, "newest entry", entry.title, entry.date)
            text = entry.text
        else:
            dated = [e.text for e in entries() if e.date == date]
            assert dated, (benchmark, date)
            text = "\n".join(dated)
        missing = _unquoted(paragraph, text)
        assert not missing, f"{benchmark} ({which}, {date}): not in RESULTS.md: {missing}"
    assert sum(p.startswith("**Latest**") for p in paragraphs) <= 1


@pytest.mark.parametrize(
    "page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_the_pages_that_cite_the_benchmarks_quote_the_latest_figures(page: Path):
    """Each line of README.md or docs/ that cites docs/benchmarks.md or RESULTS.md with a
    figure quotes figures of one benchmark's newest entry; the demo's fixed cost,
    bench_fixed_cost's."""
    if page == SUMMARY:
        return
    text = page.read_text()
    cites = ("benchmarks.md", "benchmarks/RESULTS.md")
    items = [i for i in re.split(r"\n(?=- )|\n\n", text) if any(c in i for c in cites)]
    newest = {b: latest(b).text for b in sections() if b != "bench_devices"}
    for item in items:
        if not FIGURE.search(NOT_FIGURES.sub("", item)):
            continue
        if "demo" in item:
            assert not _unquoted(item, newest["bench_fixed_cost"]), item
        else:
            assert any(not _unquoted(item, t) for t in newest.values()), item


def test_the_docs_speak_of_the_software_only():
    """No issue numbers, and no one else's work on the machine, in README.md or docs/."""
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = " ".join(page.read_text().split())
        found = re.findall(r"\b[Ii]ssues? \d+|\bengineers?\b|other people's", text)
        assert not found, (page.name, found)
