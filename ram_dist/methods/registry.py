"""The one table of methods by name (`METHODS`), complete once imported: a new method is a
module with a `METHODS` tuple (each method declaring its own parameters), plus its line
below. What a method is lives in `methods.protocol`."""

from __future__ import annotations

from ram_dist.errors import RamDistError
from ram_dist.methods import (
    arcee_fusion,
    generalized_task_arithmetic,
    linear,
    model_stock,
    nearswap,
    passthrough,
    ram,
    sce,
)
from ram_dist.methods.parameters import check_table
from ram_dist.methods.protocol import MergeMethod


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
    generalized_task_arithmetic.METHODS,
    linear.METHODS,
    model_stock.METHODS,
    sce.METHODS,
    arcee_fusion.METHODS,
    nearswap.METHODS,
    passthrough.METHODS,
)


def get_method(name: str) -> MergeMethod:
    """The method called `name`, or an error that lists the valid names."""
    if name not in METHODS:
        valid = ", ".join(sorted(METHODS))
        raise RamDistError(f"unknown merge method {name!r}; valid methods: {valid}")
    return METHODS[name]
