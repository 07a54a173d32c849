"""tests/README.md's table lists every test file once, and names no file that does not
exist; no two test files share a name (pytest imports each by its bare name); no test file
imports another (what two share lives in `tests/support/`), and none asserts how long
something took (a busy machine fails it for nothing); the quick tier
(`pytest -m quick`) has tests of every package; every `tests/....py` path the repository's
text names is a file."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent
ROOT = next(p for p in TESTS.parents if (p / "pyproject.toml").exists())
TEXT = {".md", ".py", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh"}
#: An import of a test module, in code or in a script a test runs (`from test_x import`,
#: `import test_x`, `from tests.x import`).
IMPORTS_A_TEST = re.compile(
    r"^\s*(?:from\s+(?:tests\.|test_)\S*\s+import|import\s+(?:tests\.|test_))", re.M
)
#: An assertion that bounds a duration: `assert wall < 90`, `assert elapsed_s <= 2.5`,
#: `assert time.monotonic() - start < 5` (a deadline that ends a wait is not one).
TIMED = re.compile(
    r"^\s*assert\b.*?(?:\b(?:wall|elapsed|took|duration|seconds|\w+_s)\s*<=?\s*\d"
    r"|(?:perf_counter|monotonic|time)\(\)\s*-\s*\w+\s*<=?\s*\d)",
    re.M,
)
NAMED = re.compile(r"\btests/[\w/]+\.py\b")
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


def test_no_test_file_imports_another() -> None:
    importing = [
        f"{path}: {m.group(0).strip()}"
        for path in _test_files() + [p.relative_to(TESTS).as_posix() for p in TESTS.glob("*.py")]
        for m in IMPORTS_A_TEST.finditer((TESTS / path).read_text(encoding="utf-8"))
    ]
    importing += [
        f"support/{p.name}: {m.group(0).strip()}"
        for p in (TESTS / "support").glob("*.py")
        for m in IMPORTS_A_TEST.finditer(p.read_text(encoding="utf-8"))
    ]
    assert importing == [], "\n".join(importing)


def test_no_test_asserts_a_duration() -> None:
    timed = [
        f"{path}: {m.group(0).strip()}"
        for path in _test_files()
        for m in TIMED.finditer((TESTS / path).read_text(encoding="utf-8"))
    ]
    assert timed == [], "\n".join(timed)
    for sample in ("    assert wall < 90", "assert t.elapsed_s <= 2.5",
                   "    assert time.monotonic() - start < 5"):  # fmt: skip
        assert TIMED.search(sample), sample
    for sample in ("assert 0.0 < workers.busy_share(wall) <= 1.0", "assert stats.seconds > 0",
                   "assert time.monotonic() < deadline, errors"):  # fmt: skip
        assert not TIMED.search(sample), sample


def test_the_quick_tier_touches_every_package() -> None:
    """Each package of ram_dist (tests/<package>/, the folders follow them) and the entry
    points (the `cli` package and `api`: tests/entry/) have a test file with quick tests."""
    packages = sorted(p.parent.name for p in (ROOT / "ram_dist").glob("*/__init__.py"))
    entry = {"cli"}  # an entry point's package: its tests are in tests/entry/ with the API's
    folders = {name: TESTS / name for name in packages if name not in entry}
    folders |= {"cli and api": TESTS / "entry"}
    missing = [
        name
        for name, folder in folders.items()
        if not any("pytest.mark.quick" in f.read_text() for f in folder.glob("test_*.py"))
    ]
    assert missing == [], f"no quick test for {missing}"


def _text_files() -> list[Path]:
    """The repository's text files, without hidden folders, virtual environments and
    build outputs."""
    skip = {"__pycache__", "build", "dist", "node_modules"}
    return [
        p
        for p in ROOT.rglob("*")
        if p.suffix in TEXT
        and p.is_file()
        and not any(
            part.startswith(".") or part in skip or part.endswith(".egg-info")
            for part in p.relative_to(ROOT).parts[:-1]
        )
    ]


def test_every_test_path_the_repository_names_exists() -> None:
    stale = [
        f"{p.relative_to(ROOT)}:{n}: {name}"
        for p in _text_files()
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        for name in NAMED.findall(line)
        if not (ROOT / name).is_file()
    ]
    assert stale == [], "\n".join(stale)
