"""Merge rules as pure functions of tensors, listed by name.

A method never does I/O and never touches Ray: a worker hands it one chunk of the base and
the same chunk of every task, and gets back statistics (reduce pass) or the merged chunk
(map pass). The same functions run in unit tests, on CPU workers and on GPU workers.

`METHODS` is the one table of methods, complete once this package is imported: a new method
is a module with a `METHODS` tuple (each method declaring its own parameters), plus its line
below. No module of this package imports torch when it is imported (each imports it where
it computes), so `ram-dist --help` and the YAML reader use the table without torch.
"""

from __future__ import annotations

from ram_dist.errors import RamDistError
from ram_dist.methods import baselines, ram
from ram_dist.methods.parameters import check_table
from ram_dist.methods.registry import MergeMethod


def _table(*families: tuple[MergeMethod, ...]) -> dict[str, MergeMethod]:
    table: dict[str, MergeMethod] = {}
    for method in (m for family in families for m in family):
        if method.name in table:
            raise ValueError(f"merge method {method.name!r} listed twice")
        table[method.name] = method
    check_table({name: m.parameters for name, m in table.items()})
    return table


METHODS: dict[str, MergeMethod] = _table(
    ram.METHODS,
    baselines.METHODS,
)


def get_method(name: str) -> MergeMethod:
    """The method called `name`, or an error that lists the valid names."""
    if name not in METHODS:
        valid = ", ".join(sorted(METHODS))
        raise RamDistError(f"unknown merge method {name!r}; valid methods: {valid}")
    return METHODS[name]


__all__ = ["METHODS", "MergeMethod", "get_method"]
