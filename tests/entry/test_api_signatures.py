"""The API's calls (`merge`, `probe`, `plan`, `job_config`) have real signatures, written out in
`ram_dist/api.py` so that `help()`, IDEs and type checkers see every keyword, and they are
`ram_dist/settings.py`'s settings: each one, in declaration order, keyword-only, with its
declared type. A setting added to settings.py fails here until every call takes it; the
message prints the lines the calls should hold."""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

import pytest

from ram_dist import api, settings

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

REQUIRED = inspect.Parameter.empty
CALLS = {"merge": "merge", "probe": "probe", "plan": "plan", "job_config": None}


def _expected(call: str) -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each keyword `call` takes: `config`, then its command's
    settings (`settings.api_settings`): a switch is off by default, merge's `out` is required,
    any other None (the config file's value, else the setting's default); probe's
    `json_path` last."""
    command = CALLS[call]
    out: list[tuple[str, Any, Any]] = [
        ("config", settings.PathLike | Mapping[str, Any] | None, None)
    ]
    for s in settings.api_settings(command):
        if s.type is bool:
            out.append((s.name, bool, False))
        elif command == "merge" and s.name == "out":
            out.append((s.name, s.meta.api_type, REQUIRED))
        else:
            out.append((s.name, (s.meta.api_type or s.type) | None, None))
    if command == "probe":
        out.append(("json_path", settings.PathLike | None, None))
    return out


def _written(kind: Any) -> str:
    """A type as api.py writes it (`PathLike` for `settings.PathLike`)."""
    if kind is settings.PathLike:
        return "PathLike"
    if kind is type(None):
        return "None"
    if kind is Any:
        return "Any"
    if isinstance(kind, types.UnionType):
        args = typing.get_args(kind)
        path = set(typing.get_args(settings.PathLike))
        if path <= set(args):  # `PathLike | None`
            return " | ".join(["PathLike", *(_written(a) for a in args if a not in path)])
        return " | ".join(_written(a) for a in args)
    origin = typing.get_origin(kind)
    if origin is not None:
        name = {collections.abc.Sequence: "Sequence", collections.abc.Mapping: "Mapping"}.get(
            origin, getattr(origin, "__name__", str(origin))
        )
        shown = ", ".join("..." if a is Ellipsis else _written(a) for a in typing.get_args(kind))
        return f"{name}[{shown}]"
    return kind.__name__


def _line(name: str, kind: Any, default: Any) -> str:
    return (
        f"    {name}: {_written(kind)}" + ("" if default is REQUIRED else f" = {default!r}") + ","
    )


@pytest.mark.parametrize("call", list(CALLS))
def test_each_call_takes_its_settings_with_their_declared_types(call):
    function = getattr(api, call)
    found = []
    for p in inspect.signature(function).parameters.values():
        assert p.kind is p.KEYWORD_ONLY, (call, p.name)
        kind = eval(p.annotation, vars(api)) if isinstance(p.annotation, str) else p.annotation  # noqa: S307
        found.append((p.name, kind, p.default))
    wanted = _expected(call)
    assert found == wanted, f"api.{call} must take, in this order:\n" + "\n".join(
        _line(*w) for w in wanted
    )


def test_the_package_exports_the_same_calls_and_type_checkers_see_them():
    """`ram_dist.merge` is `api.merge` at run time (loaded on first use) and, for type
    checkers and IDEs, through the package's `if TYPE_CHECKING:` import of every API name."""
    import ast
    from pathlib import Path

    import ram_dist

    for call in CALLS:
        assert getattr(ram_dist, call) is getattr(api, call), call
    tree = ast.parse(Path(ram_dist.__file__).read_text())
    seen = {
        alias.name
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in node.body
        if isinstance(inner, ast.ImportFrom) and inner.module == "ram_dist.api"
        for alias in inner.names
    }
    assert seen == set(ram_dist.API)


def test_a_wrong_or_missing_keyword_is_pythons_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'wokers'"):
        api.plan(base="b", tasks=["t1", "t2"], wokers=2)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'out'"):
        api.merge(base="b", tasks=["t1", "t2"])  # type: ignore[call-arg]
