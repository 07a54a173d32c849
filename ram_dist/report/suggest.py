"""The sweep a probe suggests (`ram-dist merge ... --method ... --grid ...` and its YAML
`sweep:` block), read off the regime map of `examples/rl-agents` at the nearest measured
point (`regime.place`).

The rule, fixed so that it can be documented and tested: RAM+ over `r` 0.05, 0.1, 0.2 and
`alpha` 1, 2 (the paper's range), beside each baseline RAM+ did not beat there (mean score
difference at most 0; the closest one when it beat them all), at most two, the one furthest
ahead first; TIES and DARE-TIES over `density` 0.3, 0.5, 0.7. The map is one small model's
measurement: the suggestion says what to try, not what will win.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

#: Baselines the map measured that a sweep can run, with the words the reason uses.
BASELINES = {"ties": "TIES", "task_arithmetic": "task arithmetic", "dare_ties": "DARE-TIES"}
#: RAM+'s grid: the values of `r` and `alpha` the paper's ablation spans.
RAM_PLUS_GRID = {"r": (0.05, 0.1, 0.2), "alpha": (1, 2)}
#: The densities tried for the methods that declare `density` here.
DENSITY = (0.3, 0.5, 0.7)
_TAKES_DENSITY = ("ties", "dare_ties")
#: At most this many baselines beside RAM+.
MOST_BASELINES = 2


def suggest(
    report: Mapping[str, Any], placed: Mapping[str, Any] | None, out: str = "./sweep"
) -> dict[str, Any] | None:
    """The suggested sweep of a probe report placed on the map; None without a place."""
    if not placed:
        return None
    deltas = placed["nearest"]["ram_plus_minus"]
    known = {b: deltas[b]["mean"] for b in BASELINES if b in deltas}
    behind = sorted((b for b, d in known.items() if d <= 0), key=lambda b: known[b])
    chosen = behind[:MOST_BASELINES] or sorted(known, key=lambda b: known[b])[:1]
    methods = ["ram_plus", *chosen]
    grid: dict[str, tuple[float, ...]] = dict(RAM_PLUS_GRID)
    if any(m in _TAKES_DENSITY for m in chosen):
        grid["density"] = DENSITY
    return {
        "methods": methods,
        "grid": {k: list(v) for k, v in grid.items()},
        "command": command(report, methods, grid, out),
        "yaml": yaml_block(methods, grid),
        "why": _why(placed, chosen, known, report),
    }


def command(
    report: Mapping[str, Any],
    methods: Sequence[str],
    grid: Mapping[str, Sequence[float]],
    out: str,
) -> str:
    """The `ram-dist merge` command line of the sweep, on the probe's own inputs."""
    words = ["ram-dist", "merge", "--base", str(report["base"])]
    for task in report.get("tasks_given") or []:
        words += ["--task", str(task)]
    words += ["--out", out]
    for m in methods:
        words += ["--method", m]
    for name, values in grid.items():
        words += ["--grid", f"{name}={','.join(_value(v) for v in values)}"]
    return shlex.join(words)


def yaml_block(methods: Sequence[str], grid: Mapping[str, Sequence[float]]) -> str:
    """The same sweep as the `sweep:` key of a YAML config (docs/sweeps.md)."""
    lines = ["sweep:", f"  methods: [{', '.join(methods)}]", "  grid:"]
    lines += [f"    {k}: [{', '.join(_value(v) for v in vs)}]" for k, vs in grid.items()]
    return "\n".join(lines) + "\n"


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _why(
    placed: Mapping[str, Any],
    chosen: Sequence[str],
    known: Mapping[str, float],
    report: Mapping[str, Any],
) -> str:
    nearest = placed["nearest"]
    against = ", ".join(
        f"{'ahead of' if known[b] > 0 else 'behind'} {BASELINES[b]} by "
        f"{abs(100 * known[b]):.1f} points"
        for b in chosen
    )
    agree = [
        t["sign_agreement"]
        for t in (report.get("agreement") or {}).get("tasks", [])
        if t.get("sign_agreement") is not None
    ]
    signs = (
        f"; your shared updates agree in sign {100 * sum(agree) / len(agree):.0f}% of the time"
        if agree
        else ""
    )
    return (
        f"at the nearest measured point ({nearest['name']}) RAM+ was {against}{signs}: "
        f"sweep RAM+'s r and alpha beside {'them' if len(chosen) > 1 else 'it'}."
    )
