"""Where a probe's agents stand on the map measured by the regime sweep of
`examples/rl-agents` (RESULTS.md, "When does RAM help?"): the nearest measured point by
density and unique share, and what RAM+ did against each baseline there.

The map (`regime_map.json`, a copy of the sweep's own output) is one small model's
measurement; the sentence says so and claims nothing beyond it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

MAP_FILE = "regime_map.json"
SOURCE = "examples/rl-agents/RESULTS.md"
"""Where the measurement is written up, in the ram-dist repository."""
_SHOWN = {"ties": "TIES", "task_arithmetic": "task arithmetic", "mean": "the plain mean"}
"""The baselines the sentence names, in that order (the map has more)."""


@cache
def measured_map() -> dict[str, Any]:
    """The shipped map: the sweep's points, each with its mean density and unique share and
    RAM+ minus each baseline (average score over three tasks, paired by seed)."""
    text = resources.files("ram_dist.report").joinpath(MAP_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def place(report: Mapping[str, Any], regime_map: Mapping[str, Any] | None = None) -> dict | None:
    """The probe's agents placed on the map; None for a report without RAM's statistics."""
    tasks = [t for t in report.get("tasks") or [] if isinstance(t, Mapping) and "density" in t]
    if not tasks:
        return None
    regime_map = measured_map() if regime_map is None else regime_map
    density = statistics.fmean(float(t["density"]) for t in tasks)
    changed = [t for t in tasks if t["changed"]]
    unique = statistics.fmean(t["unique"] / t["changed"] for t in changed) if changed else 0.0
    points = regime_map["points"]
    nearest = min(
        points,
        key=lambda p: math.hypot(p["mean_density"] - density, p["mean_unique_share"] - unique),
    )
    inside = _inside(points, density, unique)
    return {
        "density": density,
        "unique_share": unique,
        "nearest": nearest,
        "within_measured_range": inside,
        "source": SOURCE,
        "model": regime_map["model"],
        "sentence": _sentence(density, unique, nearest, inside, regime_map),
    }


def _inside(points: list[Mapping[str, Any]], density: float, unique: float) -> bool:
    d = [p["mean_density"] for p in points]
    u = [p["mean_unique_share"] for p in points]
    return min(d) <= density <= max(d) and min(u) <= unique <= max(u)


def _sentence(
    density: float,
    unique: float,
    nearest: Mapping[str, Any],
    inside: bool,
    regime_map: Mapping[str, Any],
) -> str:
    deltas = nearest["ram_plus_minus"]
    against = ", ".join(
        f"{100 * deltas[b]['mean']:+.1f} points against {label} "
        f"(ahead in {deltas[b]['ahead']} of {deltas[b]['n']} seeds)"
        for b, label in _SHOWN.items()
        if b in deltas
    )
    learned = "" if nearest["learned"] else "; not every agent learned its task there"
    where = "" if inside else " (your agents lie outside the range it measured)"
    return (
        f"Your agents changed {100 * density:.1f}% of the weights on average, "
        f"{100 * unique:.1f}% of each one's changes unique to it; the nearest point of the "
        f"regime sweep in {SOURCE}{where} is {nearest['name']} (density "
        f"{100 * nearest['mean_density']:.1f}%, unique {100 * nearest['mean_unique_share']:.1f}%"
        f"{learned}), where RAM+ scored {against} in average score over the agents' tasks, "
        f"with {regime_map['model']}: one small model's measurement, not a forecast for yours."
    )
