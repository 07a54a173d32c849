"""tests/README.md's table lists every test file once, and names no file that does not
exist; no two test files share a name (pytest imports each by its bare name)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|$")


def _rows() -> list[tuple[str, str, str]]:
    text = (TESTS / "README.md").read_text(encoding="utf-8")
    return [m.groups() for line in text.splitlines() if (m := ROW.match(line))]


def _test_files() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def test_every_test_file_has_one_row_and_every_row_a_file() -> None:
    listed = [path for path, _, _ in _rows()]
    assert [p for p, n in Counter(listed).items() if n > 1] == []
    assert sorted(set(_test_files()) - set(listed)) == []  # files the table lacks
    assert sorted(set(listed) - set(_test_files())) == []  # rows naming no test file


def test_every_row_says_what_the_file_covers_and_starts() -> None:
    rows = _rows()
    assert len(rows) == len(_test_files())
    for path, covers, starts in rows:
        assert covers.strip() and starts.strip(), path


def test_test_file_names_are_unique() -> None:
    names = Counter(Path(p).name for p in _test_files())
    assert [name for name, n in names.items() if n > 1] == []
