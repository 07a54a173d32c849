"""Merge rules as pure functions of tensors, listed by name.

A method never does I/O and never touches Ray: a worker hands it one chunk of the base and
the same chunk of every task, and gets back statistics (reduce pass) or the merged chunk
(map pass). The same functions run in unit tests, on CPU workers and on GPU workers.

`METHODS` is the one table of methods, complete on first use: a new method is a module with a
`METHODS` tuple, plus its line below, and its parameters in `methods.parameters`. The table
(and torch) is imported on first use, so that the torch-free modules of this package
(`parameters`, `layers`) serve `ram-dist --help` and the YAML reader without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError

if TYPE_CHECKING:
    from ram_dist.methods.registry import MergeMethod


def _table(*families: tuple[MergeMethod, ...]) -> dict[str, MergeMethod]:
    from ram_dist.methods.parameters import PARAMETERS

    table: dict[str, MergeMethod] = {}
    for method in (m for family in families for m in family):
        if method.name in table:
            raise ValueError(f"merge method {method.name!r} listed twice")
        table[method.name] = method
    if list(table) != list(PARAMETERS):
        raise ValueError(f"methods {list(table)} but parameters for {list(PARAMETERS)}")
    return table


@functools.cache
def _methods() -> dict[str, MergeMethod]:
    from ram_dist.methods import baselines, ram

    return _table(
        ram.METHODS,
        baselines.METHODS,
    )


def __getattr__(name: str) -> Any:
    """`METHODS` and `MergeMethod`, imported (with torch) on first use."""
    if name == "METHODS":
        return _methods()
    if name == "MergeMethod":
        from ram_dist.methods.registry import MergeMethod

        return MergeMethod
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_method(name: str) -> MergeMethod:
    """The method called `name`, or an error that lists the valid names."""
    methods = _methods()
    if name not in methods:
        valid = ", ".join(sorted(methods))
        raise RamDistError(f"unknown merge method {name!r}; valid methods: {valid}")
    return methods[name]


__all__ = ["METHODS", "MergeMethod", "get_method"]
