"""The links of README.md and docs/*.md: every relative link names a file inside the
repository (never ../shared, which a user's clone does not have), every `#anchor` names a
heading of the file it points at, and the README's index lists every file of docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def _prose(text: str) -> str:
    """The text outside fenced blocks and code spans, where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target of a Markdown text (inline links, images, reference definitions)."""
    prose = _prose(text)
    return INLINE_LINK.findall(prose) + REFERENCE_DEFINITION.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, without punctuation other than
    `-` and `_`, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a Markdown file offers: one per heading (a repeated heading gets `-1`,
    `-2`, ... as on GitHub), and explicit `<a name=...>` / `<a id=...>`."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found | set(HTML_ANCHOR.findall(text))


def test_the_helpers_read_markdown_as_github_does():
    text = "# A `flag` table, and (more)\n```bash\n# not a heading [x](nowhere.md)\n```\n"
    text += "## A `flag` table, and (more)\nsee [`x`](a.md#b) and `[y](c.md)`\n[r]: d.md\n"
    assert anchors(text) == {"a-flag-table-and-more", "a-flag-table-and-more-1"}
    assert links(text) == ["a.md#b", "d.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page: Path):
    problems = []
    for target in links(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if "shared" in Path(path).parts and ".." in Path(path).parts:
            problems.append(f"{target}: ../shared is outside the repository")
        elif ROOT not in (file, *file.parents):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{target}: {file.relative_to(ROOT)} has no heading #{anchor}")
    assert not problems, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(problems)


def test_the_readme_lists_every_docs_file():
    listed = {link.partition("#")[0] for link in links((ROOT / "README.md").read_text())}
    missing = [f"docs/{doc.name}" for doc in DOCS if f"docs/{doc.name}" not in listed]
    assert not missing, f"README.md's Documentation table misses {', '.join(missing)}"
