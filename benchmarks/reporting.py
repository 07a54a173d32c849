"""Reporting what `bench_merge` measured: ratios to the floor, medians, and the tables that
`RESULTS.md` quotes (medians per configuration, every sample, memory scaling)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ram_dist.synthetic.weights import AGENT_DENSITIES

ROWS = [
    ("wall time", "wall_s", "s"),
    ("ratio wall / floor (same repeat)", "ratio_wall", "x"),
    ("  floor: one read of all inputs", "floor_read_pass_s", "s"),
    ("  floor: write of output", "floor_write_s", "s"),
    ("reduce pass wall", "reduce_s", "s"),
    ("map pass wall", "map_s", "s"),
    ("ratio (reduce+map) / floor", "ratio_passes", "x"),
    ("startup/plan/shutdown (wall - passes)", "overhead_s", "s"),
    ("work units (map pass)", "units", "n"),
    ("driver peak RSS (report)", "driver_peak_rss_bytes", "B"),
    ("largest worker peak RSS (report)", "worker_peak_rss_bytes", "B"),
    ("driver peak private (no object store)", "driver_peak_private_bytes", "B"),
    ("largest worker peak private", "worker_peak_private_bytes", "B"),
    ("process max RSS (wait4)", "proc_maxrss_bytes", "B"),
    ("largest single process peak RSS", "largest_process_rss_bytes", "B"),
    ("bytes read (tensor data)", "bytes_read", "B"),
    ("  reduce pass bytes read", "reduce_bytes_read", "B"),
    ("  map pass bytes read", "map_bytes_read", "B"),
    ("rchar, whole process", "rchar_bytes", "B"),
    ("rchar, merge only (after imports)", "rchar_merge_bytes", "B"),
    ("output safetensors bytes", "out_bytes", "B"),
    ("output tensors", "out_tensors", "n"),
]
SAMPLE_ROWS = [
    ("wall", "wall_s", "s"),
    ("wall / floor", "ratio_wall", "x"),
    ("reduce+map", "passes_s", "s"),
    ("(reduce+map) / floor", "ratio_passes", "x"),
]


def add_ratios(samples: dict[str, list[dict[str, Any]]]) -> None:
    """Ratios to the floor measured in the same repeat (none if the floor was not run)."""
    floors = samples.get("floor")
    if floors is None:
        return
    for name, rows in samples.items():
        if name == "floor":
            continue
        for sample, floor in zip(rows, floors, strict=True):
            sample["ratio_wall"] = sample["wall_s"] / floor["wall_s"]
            passes = sample.get("passes_s")
            sample["ratio_passes"] = None if passes is None else passes / floor["wall_s"]


def median_of(values: Sequence[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = dict.fromkeys(k for s in samples for k in s)
    return {k: median_of([s.get(k) for s in samples]) for k in keys}


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "n":
        return f"{value:,.0f}"
    return f"{value / 2**20:,.0f} MiB"


def print_medians(summary: dict[str, dict[str, Any]]) -> None:
    """Medians, one column per configuration; rows that no configuration has are left out."""
    names = list(summary)
    width = max(len(label) for label, _, _ in ROWS)
    cols = [max(12, len(n)) for n in names]
    print(
        "\nmedians"
        + " " * (width - 5)
        + "".join(f"  {n:>{w}}" for n, w in zip(names, cols, strict=True))
    )
    print("-" * (width + sum(c + 2 for c in cols)))
    for label, key, unit in ROWS:
        values = [summary[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        cells = "".join(f"  {fmt(v, unit):>{w}}" for v, w in zip(values, cols, strict=True))
        print(f"{label:<{width}}{cells}")


def print_samples(samples: dict[str, list[dict[str, Any]]]) -> None:
    """Every sample of the timing rows, with its median and minimum."""
    repeats = max(len(s) for s in samples.values())
    width = max(len(n) for n in samples) + 2 + max(len(label) for label, _, _ in SAMPLE_ROWS)
    runs = "".join(f"  {'run ' + str(k + 1):>10}" for k in range(repeats))
    print(f"\n{'samples':<{width}}  {'median':>10}  {'min':>10}{runs}")
    print("-" * (width + 24 + 12 * repeats))
    for name, rows in samples.items():
        for label, key, unit in SAMPLE_ROWS:
            values = [s.get(key) for s in rows]
            present = [v for v in values if v is not None]
            if not present:
                continue
            cells = "".join(f"  {fmt(v, unit):>10}" for v in values)
            line = f"{name + '  ' + label:<{width}}  {fmt(median_of(values), unit):>10}"
            print(f"{line}  {fmt(min(present), unit):>10}{cells}")


def print_task_stats(report: dict[str, Any]) -> None:
    """Sanity line: the statistics the merge found against the generated densities."""
    tasks = report.get("tasks")
    if not isinstance(tasks, list):
        return
    lambdas = report.get("lambda_applied")
    print("\nram-dist ram_plus statistics (last run) vs generated mask density:")
    for k, task in enumerate(tasks):
        expected = AGENT_DENSITIES[k] if k < len(AGENT_DENSITIES) else "n/a"
        density, rho = task.get("density", "n/a"), task.get("rho", "n/a")
        lam = lambdas[k] if isinstance(lambdas, list) and k < len(lambdas) else "n/a"
        print(
            f"  task {k + 1}: generated density {expected}; reported density {density}, "
            f"rho {rho}, lambda applied {lam}"
        )


def print_memory_scaling(rows: list[dict[str, Any]], unit_mb: int) -> None:
    """Per size: worker and driver peaks, as RSS (with the pages of Ray's object store that
    the process touched) and private (without them), and the spread of the worker peaks."""
    print(f"\nmemory scaling: ram-dist ram_plus, --unit-mb {unit_mb}, one run per size")
    print(
        f"{'params':>14}  {'inputs':>10}  {'units':>6}  {'worker RSS':>11}  "
        f"{'worker private':>14}  {'driver RSS':>11}  {'driver private':>14}"
    )
    for row in rows:
        print(
            f"{row['params']:>14,}  {fmt(row['input_bytes'], 'B'):>10}  "
            f"{fmt(row['units'], 'n'):>6}  {fmt(row['worker_peak_rss_bytes'], 'B'):>11}  "
            f"{fmt(row.get('worker_peak_private_bytes'), 'B'):>14}  "
            f"{fmt(row['driver_peak_rss_bytes'], 'B'):>11}  "
            f"{fmt(row.get('driver_peak_private_bytes'), 'B'):>14}"
        )
    for key, label in (
        ("worker_peak_private_bytes", "worker peak private"),
        ("worker_peak_rss_bytes", "worker peak RSS"),
    ):
        peaks = [r[key] for r in rows if r.get(key)]
        if len(peaks) >= 2:
            spread = max(peaks) / min(peaks)
            verdict = "within" if spread <= 1.2 else "NOT within"
            print(f"largest / smallest {label}: {spread:.2f}x ({verdict} the 20 % target)")
