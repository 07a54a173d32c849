"""The package's layers, as docs/architecture.md's "Package layers" names them: a module imports
only from layers below its own, never sideways into another package of its layer, and the
tables every layer uses (errors, dtypes, settings) import no layer at module level.

Read from the source with `ast`, so it holds for imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PACKAGE = ROOT / "ram_dist"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
RANK = {
    "cli": 6,
    "api": 6,
    "engine": 5,
    "planning": 4,
    "report": 3,
    "mergekit_config": 3,
    "synthetic": 3,
    "io": 2,
    "methods": 1,
    "kernels": 0,
}
TABLES = {"errors", "dtypes", "settings"}
"""Used by every layer. `settings` parses a flag's value with helpers of io and methods,
inside the function that parses it; at module level it imports only the other tables."""


def _is_module(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def _imports(tree: ast.AST) -> list[tuple[str, bool]]:
    """(imported ram_dist module, imported at module level) for every import but those
    under `if TYPE_CHECKING:`, which only annotations read."""
    top_level = {id(n) for n in getattr(tree, "body", [])}
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "ram_dist":  # modules, not the package's own names
                names = [f"ram_dist.{a.name}" for a in node.names if _is_module(a.name)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(n, id(node) in top_level) for n in names if n.startswith("ram_dist.")]
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        home = parts[0]
        if home == "__init__":
            continue  # the package's lazy export list
        for module, at_top in _imports(ast.parse(path.read_text())):
            target = module.split(".")[1]
            if target in TABLES or target == home:
                continue
            where = f"{'/'.join(parts)}.py imports {module}"
            if home in TABLES:
                if at_top:
                    bad.append(f"{where}: a table imports no layer at module level")
                continue
            if target not in RANK:
                bad.append(f"{where}: not a layer of docs/architecture.md's table")
            elif RANK[target] >= RANK[home] and RANK[home] != RANK["cli"]:
                bad.append(f"{where}: {target} is not below {home}")
    return bad


def test_imports_only_run_downward():
    assert _violations() == []


def test_every_module_is_in_a_named_layer():
    homes = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")}
    assert homes - {"__init__"} <= set(RANK) | TABLES


def test_the_architecture_doc_names_the_layers():
    section = ARCHITECTURE.read_text().split("\n## Package layers\n", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table, "docs/architecture.md lost its table of layers"
    for name in RANK:
        layer = f"`{name}/`" if (PACKAGE / name).is_dir() else f"`{name}.py`"
        assert layer in table, name
    for name in TABLES:
        assert f"`{name}`" in section.split("|", 1)[0], name


def _modules_of(layer: str) -> set[str]:
    """The modules and sub-packages of one package of the package (`engine`: its files)."""
    found = set()
    for path in (PACKAGE / layer).iterdir():
        if path.is_dir() and (path / "__init__.py").is_file():
            found.add(f"{path.name}/")
        elif path.suffix == ".py" and path.stem != "__init__":
            found.add(path.stem)
    return found


def test_the_architecture_table_lists_each_packages_modules_exactly():
    """Each package's row names every module it holds and no module it does not hold, so a
    rename that forgets the doc fails here."""
    import re

    section = ARCHITECTURE.read_text().split("\n## Package layers\n", 1)[1].split("\n## ", 1)[0]
    checked = set()
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        layers = [n for n in re.findall(r"`([a-z_]+)/`", cells[0]) if (PACKAGE / n).is_dir()]
        if not layers:
            continue
        listed = set(re.findall(r"`([a-z_0-9]+/?)`", re.sub(r"\([^)]*\)", "", cells[1])))
        held = set().union(*(_modules_of(layer) for layer in layers))
        assert listed == held, (layers, sorted(listed - held), sorted(held - listed))
        checked.update(layers)
    assert checked == {n for n in RANK if (PACKAGE / n).is_dir()}


def test_modules_stay_small_and_the_package_top_holds_few():
    """No module of the package over 500 lines, and at most 6 loose modules at its top
    (`__init__` counted): a module that grows past it is split by what it does."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 6, loose
