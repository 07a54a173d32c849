"""The engine holds objects, not argument lists: no function of `ram_dist/engine` takes more
than six parameters (a pass's context is a `PassContext`, a task's a `TaskContext`)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "ram_dist" / "engine"
MOST = 6


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_engine_function_takes_more_than_six_parameters():
    wide = [
        f"{path.name}: {node.name} ({len(_parameters(node))})"
        for path in sorted(ENGINE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(_parameters(node)) > MOST
    ]
    assert wide == []
