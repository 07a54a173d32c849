"""A back-of-the-envelope scaling model for 70B and 405B merges, from one bench_merge run.

Usage::

    python -m benchmarks.scaling results.json [--bandwidth-gbs 1.0] [--cores-per-node 16]

from the repository root. It reads the JSON that ``bench_merge --json`` writes (it needs
``ramdist:ram_plus`` in the runs) and prints Markdown: bytes moved per pass, work units at
the measured unit budget, memory per worker, and estimated pass times for 1 to 128 workers.
It is a MODEL, not a measurement: it extrapolates per-worker throughput measured on a small
synthetic model and assumes the passes scale linearly with workers until the storage
bandwidth of the nodes caps them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHECKPOINTS = 4  # base + 3 tasks
DTYPE_BYTES = 2  # bf16
GB = 1e9


def rate_per_worker(result: dict[str, Any]) -> tuple[float, int]:
    """Worker-seconds per GB of input for ram_plus's two passes, and the workers it used.

    Both passes read every input once, so ``(reduce + map) * workers / input GB`` is the work
    one worker does per GB of checkpoint data, reading it twice and writing the output once.
    """
    med = result.get("median", {}).get("ramdist:ram_plus")
    if not med or med.get("reduce_s") is None or med.get("map_s") is None:
        raise SystemExit("the results hold no ramdist:ram_plus pass times; run it in --runs")
    workers = int(med.get("workers_used") or 1)
    input_gb = result["model"]["input_bytes"] / GB
    return (med["reduce_s"] + med["map_s"]) * workers / input_gb, workers


def fmt_time(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def size_table(params: float, unit_budget_bytes: int) -> list[str]:
    """Bytes and work units for one model size."""
    per_input = DTYPE_BYTES * params
    units = math.ceil(per_input / unit_budget_bytes)
    return [
        f"| input bytes per pass (4 x 2 B x params) | {CHECKPOINTS * per_input / GB:,.0f} GB |",
        f"| bytes read, both passes | {2 * CHECKPOINTS * per_input / GB:,.0f} GB |",
        f"| bytes written (merged bf16 model) | {per_input / GB:,.0f} GB |",
        f"| work units per pass (~ 2 B x params / unit budget) | {units:,} |",
    ]


def time_table(
    params: float,
    unit_budget_bytes: int,
    rate: float,
    workers: Sequence[int],
    cores_per_node: int,
    bandwidth_gbs: float,
) -> list[str]:
    """Estimated pass time per worker count: linear scaling, capped by storage bandwidth."""
    per_input = DTYPE_BYTES * params
    input_gb = CHECKPOINTS * per_input / GB
    moved_gb = (2 * CHECKPOINTS * per_input + per_input) / GB
    units = math.ceil(per_input / unit_budget_bytes)
    lines = [
        "| workers | nodes | linear scaling | storage cap | estimate | bound by |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for w in workers:
        nodes = math.ceil(w / cores_per_node)
        linear = rate * input_gb / min(w, units)
        storage = moved_gb / (nodes * bandwidth_gbs)
        bound = "compute" if linear >= storage else "storage"
        lines.append(
            f"| {w} | {nodes} | {fmt_time(linear)} | {fmt_time(storage)} | "
            f"{fmt_time(max(linear, storage))} | {bound} |"
        )
    return lines


def mergekit_lines(result: dict[str, Any], sizes: Sequence[float]) -> list[str]:
    """mergekit's measured wall per GB of input, extrapolated (one process, no workers)."""
    input_gb = result["model"]["input_bytes"] / GB
    lines: list[str] = []
    for name, med in result.get("median", {}).items():
        if not name.startswith("mergekit:") or med.get("wall_s") is None:
            continue
        per_gb = med["wall_s"] / input_gb
        est = ", ".join(
            f"{p / 1e9:g}B: {fmt_time(per_gb * CHECKPOINTS * DTYPE_BYTES * p / GB)}" for p in sizes
        )
        lines.append(f"* `{name}`: {per_gb:.1f} s per GB of input -> {est}")
    return lines


def unit_budget_of(result: dict[str, Any]) -> int:
    """The unit budget the ram_plus runs used: the one given, else the one ram-dist chose
    (recorded in its report)."""
    if result["config"].get("unit_mb") is not None:
        return int(result["config"]["unit_mb"] * 2**20)
    return int(result["last_reports"]["ramdist:ram_plus"]["unit_budget_bytes"])


def memory_lines(result: dict[str, Any]) -> list[str]:
    med = result["median"]["ramdist:ram_plus"]
    lines = [
        f"* largest worker peak RSS, measured: {gib(med.get('worker_peak_rss_bytes'))} at "
        f"--unit-mb {unit_budget_of(result) // 2**20}; a worker holds two read blocks of at "
        "most 4M elements per input and one unit's merged bytes (at most unit-mb), so it is "
        "bounded by the unit budget, not by the model size: the same figure is assumed for "
        "70B and 405B.",
        f"* driver peak RSS, measured: {gib(med.get('driver_peak_rss_bytes'))}; on the direct "
        "output paths (S3 parts, a local or shared filesystem) no merged byte reaches the "
        "driver, which keeps the plan, the statistics and the manifest; the memory scaling "
        "rows, if any, show whether it grows with the model.",
    ]
    unit_budget_bytes = unit_budget_of(result)
    if result["model"]["base_bytes"] < unit_budget_bytes:
        lines.append(
            "* CAUTION: the measured model is smaller than one unit budget per input "
            f"({gib(result['model']['base_bytes'])} < {gib(unit_budget_bytes)}), so its work units "
            "were smaller than a 70B model's: the worker figure understates a full unit. "
            "Measure with --params of at least unit-mb x 2**20 / 2, or use the memory scaling "
            "rows."
        )
    rows = result.get("memory_scaling") or []
    if rows:
        lines.append("* memory scaling run (ram_plus, one run per size, same --unit-mb):")
        for row in rows:
            lines.append(
                f"  * {row['params'] / 1e9:.3f} B params: largest worker "
                f"{gib(row.get('worker_peak_rss_bytes'))}, driver "
                f"{gib(row.get('driver_peak_rss_bytes'))}, {row.get('units')} units"
            )
    return lines


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    rate, used = rate_per_worker(result)
    unit_budget_bytes = unit_budget_of(result)
    model = result["model"]
    out = [
        "# ram-dist scaling model (an extrapolation, not a measurement)",
        "",
        f"Measured: {model['params'] / 1e9:.3f} B params x {CHECKPOINTS} checkpoints, "
        f"ram_plus reduce + map = {rate:.1f} worker-seconds per GB of input "
        f"({used} worker(s) used, {result.get('cpus', '?')} CPUs on the machine).",
        "",
        "Assumptions: bf16 base + 3 tasks; the two passes scale linearly with workers (up to "
        "one worker per work unit) until storage bandwidth caps them at "
        f"{args.bandwidth_gbs:g} GB/s per node, {args.cores_per_node} workers per node "
        "(nodes = ceil(workers / cores per node)); the storage cap counts both reads of every "
        "input and one write of the output. Start-up (Ray, planning) and the network between "
        "nodes are not modelled; per-worker throughput on another machine will differ.",
    ]
    for params in args.sizes:
        out += ["", f"## {params / 1e9:g}B parameters", "", "| quantity | value |", "|---|---:|"]
        out += size_table(params, unit_budget_bytes)
        out += ["", "Estimated time of the two passes:", ""]
        out += time_table(
            params, unit_budget_bytes, rate, args.workers, args.cores_per_node, args.bandwidth_gbs
        )
    out += ["", "## Memory per worker", ""] + memory_lines(result)
    mk = mergekit_lines(result, args.sizes)
    if mk:
        out += ["", "## mergekit, its measured rate extrapolated", ""]
        out += [
            "One process on one machine; rate = median wall time (start-up included, which "
            "overstates it for small measured models) per GB of input, times the size.",
            "",
        ]
        out += mk
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path, help="JSON written by bench_merge.py --json")
    p.add_argument("--bandwidth-gbs", type=float, default=1.0, help="storage GB/s per node")
    p.add_argument("--cores-per-node", type=int, default=16, help="workers per node")
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 8, 32, 128],
        help="worker counts (comma list)",
    )
    p.add_argument(
        "--sizes",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[70e9, 405e9],
        help="parameter counts (comma list)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(report(json.loads(args.results.read_text()), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
