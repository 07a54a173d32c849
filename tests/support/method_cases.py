"""Every method of the registry (`ram_dist.methods.registry.METHODS`) as a test case, for the
tests that must cover every method: a new method is a case of each of them without an edit
here, unless it requires a parameter no method had before (then `case_parameters` says so).

What a method can take comes from the method object itself: how many task models
(`task_counts`), which parameters it requires (a declared default of None), which of its
switches make it compute on whole rows (`whole_rows`). Only the values are chosen here.
"""

from __future__ import annotations

from typing import Any

from ram_dist.methods.registry import METHODS

#: A value for each parameter that some method requires (its declared default is None), by
#: the parameter's name: slerp's factor t, nuslerp's and multislerp's weight per task.
REQUIRED: dict[str, Any] = {"t": 0.3, "weight": 0.6}
#: Where one name means another thing in another method: nearswap's t is a distance, about
#: the size of the tiny checkpoints' changes.
REQUIRED_BY_METHOD: dict[tuple[str, str], Any] = {("nearswap", "t"): 0.01}
#: Values that make a method select, drop or cut rather than keep every change, by the
#: parameter's name (each method's own default otherwise).
SELECTING: dict[str, Any] = {"density": 0.5, "gamma": 0.05, "select_topk": 0.5}


def case_parameters(name: str) -> dict[str, Any]:
    """The parameters of `name`'s case: its required ones, and the selecting ones it has."""
    params: dict[str, Any] = {}
    for p in METHODS[name].parameters:
        if p.default is None:
            if (name, p.name) in REQUIRED_BY_METHOD:
                params[p.name] = REQUIRED_BY_METHOD[(name, p.name)]
            elif p.name in REQUIRED:
                params[p.name] = REQUIRED[p.name]
            else:
                raise KeyError(
                    f"method {name} requires parameter {p.name}: give it a value in "
                    "tests/support/method_cases.py (REQUIRED)"
                )
        elif p.name in SELECTING and p.effect:
            params[p.name] = SELECTING[p.name]
    return params


def task_count(name: str, available: int) -> int:
    """How many of `available` task models `name` merges: all it may take."""
    least, most = METHODS[name].task_counts
    n = available if most is None else min(most, available)
    if n < least:
        raise ValueError(f"method {name} merges at least {least} task models, not {available}")
    return n


def tensor_parameters(name: str, params: dict[str, Any], n_tasks: int) -> dict[str, Any]:
    """`params` over the declared defaults, as one tensor's parameters (per task: lists):
    what `whole_rows` and `fuses` are asked."""
    out = {}
    for p in METHODS[name].parameters:
        value = params.get(p.name, p.default)
        out[p.name] = [value] * n_tasks if p.per_task else value
    return out


def row_variants(name: str) -> list[dict[str, Any]]:
    """`name`'s case with each of its true/false parameters flipped that changes whether it
    computes on whole rows (model_stock's filter_wise, nuslerp's nuslerp_flatten): the
    chunks are cut otherwise."""
    method, params = METHODS[name], case_parameters(name)
    n = task_count(name, 3)
    rows = method.whole_rows(tensor_parameters(name, params, n))
    out = []
    for p in method.parameters:
        if p.kind is bool and p.default is not None and p.effect:
            flipped = params | {p.name: not params.get(p.name, p.default)}
            if method.whole_rows(tensor_parameters(name, flipped, n)) != rows:
                out.append(flipped)
    return out


def every_method(rows: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters) for every registered method, in the registry's order; with `rows`,
    also each method's `row_variants`."""
    cases = []
    for name in METHODS:
        cases.append((name, case_parameters(name)))
        if rows:
            cases += [(name, variant) for variant in row_variants(name)]
    return cases


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    """A test id: the method's name, then any parameter set differently from the case's."""
    name, params = case
    extra = {k: v for k, v in params.items() if case_parameters(name).get(k, "-") != v}
    return name + "".join(f"-{k}={v}" for k, v in sorted(extra.items()))
