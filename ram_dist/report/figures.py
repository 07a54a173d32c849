"""Pictures and tables of a probe or merge report: the paper's Figure 2, a per-layer table and
heatmap, and a Markdown summary.

Pure functions of the report dict (the JSON `ram-dist probe --json` and `merge_report.json`
hold); the `write_*` functions write only the file they are given. matplotlib is imported
inside the functions, so importing ram_dist stays fast, and draws through its Agg canvas on a
`Figure` of its own (pyplot and its global backend are never touched). The images have a fixed
size: Figure 2 is 1000 x 400 pixels, the heatmap 800 x 600.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from ram_dist.report.model_card import (
    format_parameters,
    md_cell,
    md_code,
    method_facts,
    method_lines,
    ram_task_table,
    redact_location,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DPI",
    "FIGURE2_SIZE",
    "HEATMAP_SIZE",
    "LAYER_COLUMNS",
    "figure2",
    "figure2_data",
    "layer_heatmap",
    "layer_table",
    "markdown_summary",
    "write_figure2",
    "write_layer_csv",
    "write_layer_heatmap",
]

DPI = 100
FIGURE2_SIZE = (10.0, 4.0)  # inches: 1000 x 400 pixels at DPI
HEATMAP_SIZE = (8.0, 6.0)  # inches: 800 x 600 pixels at DPI
LAYER_COLUMNS = (
    "layer",
    "task",
    "model",
    "changed",
    "unique",
    "shared",
    "participating",
    "density",
    "unique_share",
)

PathOrFile = str | os.PathLike[str] | IO[bytes]


def figure2_data(report: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of Figure 2, per task in task order.

    - `density[t]`: the share of the participating elements task t changed (the report's
      `density`, a fraction in [0, 1]).
    - `counts[t][j]`: elements task t changed that exactly j OTHER tasks changed too
      (`histogram[k]` counts k tasks in all, so j = k - 1; j = 0 is the unique changes).
    - `shares[t][j] = counts[t][j] / changed[t]` (all 0.0 for a task that changed nothing).

    Raises ValueError when the report has no per-task statistics (a baseline's merge report)
    or they do not add up.
    """
    tasks = _tasks(report)
    n = len(tasks)
    counts, shares = [], []
    for i, t in enumerate(tasks, 1):
        hist = [int(v) for v in t["histogram"]]
        changed = int(t["changed"])
        if len(hist) != n or sum(hist) != changed:
            raise ValueError(
                f"task {i}: histogram {hist} does not hold {n} counts adding up to "
                f"changed = {changed}"
            )
        counts.append(hist)
        shares.append([c / changed if changed else 0.0 for c in hist])
    return {
        "labels": [_label(i, t.get("model")) for i, t in enumerate(tasks, 1)],
        "models": [redact_location(str(t.get("model", ""))) for t in tasks],
        "changed": [int(t["changed"]) for t in tasks],
        "density": [float(t["density"]) for t in tasks],
        "others": list(range(n)),
        "counts": counts,
        "shares": shares,
    }


def figure2(report: Mapping[str, Any]) -> Figure:
    """Figure 2 as a matplotlib Figure (Agg canvas, 1000 x 400 px). Left: one bar per task,
    its density in percent. Right: one stacked bar per task, a segment per number j of other
    tasks that changed the same elements, its share in percent; the segments of bar t are
    the BarContainer labelled `with j other(s)` (j = 0: `unique`), in order of j."""
    data = figure2_data(report)
    fig = _figure(FIGURE2_SIZE)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
    n = len(data["labels"])
    x = list(range(n))
    colors = _colors(n)

    heights = [100 * d for d in data["density"]]
    bars = left.bar(x, heights, color="#4c72b0", label="density")
    left.bar_label(bars, labels=[f"{h:.1f}%" for h in heights], padding=2, fontsize=8)
    tick = {"rotation": 30, "ha": "right"} if n > 4 else {}
    left.set_xticks(x, data["labels"], **tick)
    left.set_ylabel("changed elements (% of weights)")
    left.set_ylim(0, 108)  # room for the labels above a bar at 100%
    left.set_title("Density of each task vector", fontsize=10)

    bottom = [0.0] * n
    for j in data["others"]:
        seg = [100 * data["shares"][t][j] for t in range(n)]
        label = "unique (0 others)" if j == 0 else f"with {j} other{'s' if j > 1 else ''}"
        right.bar(x, seg, bottom=bottom, color=colors[j], label=label)
        bottom = [b + s for b, s in zip(bottom, seg, strict=True)]
    right.set_xticks(x, data["labels"], **tick)
    right.set_ylim(0, 100)
    right.set_ylabel("share of the task's changed elements (%)")
    right.set_title("Changed elements by number of other tasks changing them", fontsize=10)
    right.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


def write_figure2(report: Mapping[str, Any], path: PathOrFile) -> None:
    """Write Figure 2 as a PNG of 1000 x 400 pixels."""
    _save(figure2(report), path)


def layer_table(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (layer, task), layers in the report's order, tasks in task order:
    the counts, `density = changed / participating` and `unique_share = unique / changed`
    (None where the denominator is 0). `task` counts from 1; `model` is the task's location.
    A report without per-layer statistics gives no rows."""
    models = _models(report)
    rows = []
    for layer in report.get("layers") or []:
        for i, t in enumerate(layer["tasks"]):
            changed, unique = int(t["changed"]), int(t["unique"])
            participating = int(t["participating"])
            rows.append(
                {
                    "layer": str(layer["layer"]),
                    "task": i + 1,
                    "model": models[i] if i < len(models) else "",
                    "changed": changed,
                    "unique": unique,
                    "shared": int(t["shared"]),
                    "participating": participating,
                    "density": changed / participating if participating else None,
                    "unique_share": unique / changed if changed else None,
                }
            )
    return rows


def write_layer_csv(report: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write `layer_table` as CSV with the header LAYER_COLUMNS; None is an empty field and
    floats are written with every digit (`repr`), so reading back gives the same numbers."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=LAYER_COLUMNS)
        writer.writeheader()
        for row in layer_table(report):
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def layer_heatmap(report: Mapping[str, Any]) -> Figure:
    """Density per (layer, task) as a matplotlib Figure (Agg canvas, 800 x 600 px): rows are
    layers in the report's order, columns tasks; the image's array holds the densities in
    percent (masked where a layer has no participating element), with a colorbar."""
    import numpy as np

    rows = layer_table(report)
    if not rows:
        raise ValueError("the report has no per-layer statistics ('layers')")
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    n_tasks = max(r["task"] for r in rows)
    grid = np.full((len(layers), n_tasks), np.nan)
    for r in rows:
        if r["density"] is not None:
            grid[layers.index(r["layer"]), r["task"] - 1] = 100 * r["density"]
    values = np.ma.masked_invalid(grid)

    fig = _figure(HEATMAP_SIZE)
    ax = fig.subplots()
    top = float(values.max()) if values.count() else 0.0
    image = ax.imshow(
        values, aspect="auto", cmap="viridis", vmin=0.0, vmax=top if top > 0 else 1.0,
        interpolation="nearest",
    )  # fmt: skip
    fig.colorbar(image, ax=ax, label="density (% of the layer's elements changed)")
    models = {r["task"]: r["model"] for r in rows}
    tick = {"rotation": 30, "ha": "right"} if n_tasks > 4 else {}
    labels = [_label(t, models.get(t)) for t in range(1, n_tasks + 1)]
    ax.set_xticks(range(n_tasks), labels, **tick)
    step = max(1, math.ceil(len(layers) / 40))
    ax.set_yticks(range(0, len(layers), step), layers[::step], fontsize=7 if step > 1 else 8)
    ax.set_xlabel("task")
    ax.set_title("Task-vector density per layer", fontsize=10)
    if len(layers) * n_tasks <= 120:
        for (li, ti), v in np.ndenumerate(grid):
            if not math.isnan(v):
                light = v < 0.6 * (top or 1.0)
                ax.text(ti, li, f"{v:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if light else "black")  # fmt: skip
    return fig


def write_layer_heatmap(report: Mapping[str, Any], path: PathOrFile) -> None:
    """Write the per-layer density heatmap as a PNG of 800 x 600 pixels."""
    _save(layer_heatmap(report), path)


def markdown_summary(report: Mapping[str, Any]) -> str:
    """A Markdown summary of a probe or merge report to paste into a document: method and
    parameters, per task its statistics and lambda under each method, the overlap
    histogram, and where the model is (or that a probe wrote none)."""
    method = str(report.get("method", ""))
    kind = "merge" if "output" in report else "probe"
    facts = method_facts(method)
    label = facts.label if facts is not None else method
    lines = [f"### ram-dist {kind}: {label} (`{method}`)", ""]
    shown = format_parameters(report.get("parameters") or {}, method)
    params = ", ".join(f"{k}={v}" for k, v in shown)
    lines.append(f"- ram-dist {report.get('ram_dist_version', '?')}; parameters: {md_cell(params)}")
    lines.append(f"- base: {md_code(redact_location(str(report.get('base', ''))))}")
    out = report.get("output")
    if out:
        lines.append(f"- merged model: {md_code(redact_location(str(out.get('url', ''))))}")
    else:
        lines.append("- probe only: no model written")
    el = report.get("elements") or {}
    if el.get("participating") is not None:
        part, none = el["participating"], el.get("unchanged", 0)
        pct = f" ({100 * none / part:.2f}%)" if part else ""
        lines.append(f"- participating elements: {part}; changed by no task: {none}{pct}")
    for line in method_lines(report):
        lines.append(f"- {md_cell(line)}")
    for note in report.get("notes") or []:
        lines.append(f"- note: {md_cell(note)}")
    formats = report.get("formats")
    if formats:
        given = "; ".join(f"{i['role']}: {i['format']}" for i in formats["inputs"])
        lines.append(f"- formats: {md_cell(given)}; output: {md_cell(formats['output'])}")
    copied = (report.get("integers_from_base") or {}).get("copied_though_changed") or []
    if copied:
        lines.append(f"- copied from the base though a task changed them: {len(copied)} "
                     "integer or bool tensor(s) (--integers-from-base)")  # fmt: skip
    if report.get("regime"):
        lines.append(f"- where your agents stand: {md_cell(report['regime']['sentence'])}")
    if report.get("suggested_sweep"):
        sweep = report["suggested_sweep"]
        lines.append(f"- to try: `{sweep['command']}` ({md_cell(sweep['why'])})")
    for name, p in (report.get("passes") or {}).items():
        if p.get("skipped"):
            lines.append(f"- {name} pass: skipped (statistics reused from the manifest)")
        else:
            lines.append(
                f"- {name} pass: {p.get('units')} units, {p.get('wall_s')} s, "
                f"{p.get('bytes_read')} bytes read, {p.get('bytes_written', 0)} bytes written"
            )

    if facts is not None and facts.reports_overlap and report.get("tasks"):
        lines += ["", "#### Per task", ""] + ram_task_table(report)
        tasks = report["tasks"]
        n = len(tasks)
        lines += [
            "",
            "#### Overlap histogram",
            "",
            "Elements task t changed that exactly k tasks changed (k = 1: unique to the task); "
            "in parentheses, the share of the task's changed elements.",
            "",
            "| task | " + " | ".join(f"k={k}" for k in range(1, n + 1)) + " |",
            "|" + "|".join("---:" for _ in range(n + 1)) + "|",
        ]
        for i, t in enumerate(tasks, 1):
            changed = t["changed"]
            cells = [
                f"{c} ({100 * c / changed:.1f}%)" if changed else str(c) for c in t["histogram"]
            ]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    else:
        lines += ["", "#### Tasks", ""]
        lines += [
            f"{i}. {md_code(redact_location(str(t)))}"
            for i, t in enumerate(report.get("tasks_given") or [], 1)
        ]
    return "\n".join(lines) + "\n"


def _tasks(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    tasks = report.get("tasks")
    if not tasks:
        raise ValueError(
            f"the report of method {report.get('method')!r} has no per-task statistics "
            "('tasks'); run `ram-dist probe` for them"
        )
    return list(tasks)


def _models(report: Mapping[str, Any]) -> list[str]:
    tasks = report.get("tasks") or []
    given = report.get("tasks_given") or []
    n = max(len(tasks), len(given))
    out = []
    for i in range(n):
        model = tasks[i].get("model") if i < len(tasks) else None
        if model is None and i < len(given):
            model = given[i]
        out.append(redact_location(str(model or "")))
    return out


def _label(i: int, model: Any) -> str:
    """`1`, or `1: coder` (the last part of the location, its last 16 characters)."""
    if not model:
        return str(i)
    name = redact_location(str(model)).rstrip("/").rsplit("/", 1)[-1]
    if len(name) > 16:
        name = "\u2026" + name[-15:]  # the end tells agents apart: org/agent-v1, org/agent-v2
    return f"{i}: {name}"


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.15 + 0.75 * j / max(1, n - 1)) for j in range(n)]


def _figure(size: tuple[float, float]) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: PathOrFile) -> None:
    # No bbox_inches="tight": the image keeps the figure's fixed size in pixels.
    fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
