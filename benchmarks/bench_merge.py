"""End-to-end benchmark of ``ram-dist merge`` and mergekit against a plain-I/O floor.

What it does, in one run:

1. Generates (once; cached in ``--workdir`` and reused when the parameters match) a synthetic
   bf16 Llama-like base checkpoint and three "RL agents" fine-tuned from it
   (``benchmarks/inputs.py``, with ``ram_dist.synthetic``, the builder of the demo and the
   tests). Each agent has a sparse task vector with an independent, seeded Bernoulli mask
   (densities about 3 %, 46 % and 54 %, as reported for RL-trained agents) and changes large
   enough to survive bf16 rounding and the merge's ``eps = 1e-5`` threshold. Generation works
   tensor by tensor and holds at most one output shard in memory.
2. Warms the page cache by reading every input once, then measures every configuration of
   ``--runs``, ``--repeats`` times, in an order that rotates by one each repeat:

   * ``floor``: read every input byte twice (the merge has a reduce pass and a map pass,
     each reading all inputs), with plain buffered 16 MiB reads, and write as many bytes as
     the base's safetensors files once (no fsync, like the merge);
   * ``ramdist:METHOD``: ``ram-dist merge`` as a subprocess, wall time and max RSS (wait4)
     measured from outside, ``OUT/merge_report.json`` read for pass times, bytes, memory;
   * ``mergekit:METHOD``: ``mergekit-yaml`` on the same inputs with matching parameters, run
     in-process by ``mergekit_wrapper.py`` (which records ``/proc/self/io`` and the tensor
     bytes mergekit loaded), wall time and max RSS from wait4.

   Every output is checked to hold every tensor of the model (``benchmarks/running.py``).
3. Prints medians (one column per configuration), every sample (``benchmarks/reporting.py``),
   and ``--json FILE`` writes it all. ``--memory-sizes`` also runs ram-dist ``ram_plus`` once
   per model size and compares the largest worker's peak RSS across sizes.

Example::

    python -m benchmarks.bench_merge --params 0.5e9 --workdir /tmp/ramdist-bench --repeats 3

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.commands import (
    DEFAULT_RUNS,
    MethodParams,
    Run,
    cli_command,
    mergekit_options,
    parse_runs,
)
from benchmarks.inputs import ensure_models
from benchmarks.reporting import (
    add_ratios,
    medians,
    print_medians,
    print_memory_scaling,
    print_samples,
    print_task_stats,
)
from benchmarks.running import Bench, cpu_count, measure_all, warm_page_cache


def parse_sizes(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=0.5e9, help="parameters per model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default=DEFAULT_RUNS, help="configurations to measure, or none")
    p.add_argument(
        "--unit-mb", type=int, default=None, help="ram-dist --unit-mb (default: its own)"
    )
    p.add_argument(
        "--memory-unit-mb", type=int, default=64, help="--unit-mb of the memory-scaling runs"
    )
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--r", type=float, default=0.1, help="RAM+ r (ram-dist and mergekit)")
    p.add_argument("--alpha", type=float, default=2.0, help="RAM+ alpha (both tools)")
    p.add_argument("--eps", type=float, default=1e-5, help="RAM epsilon (both tools)")
    p.add_argument("--ties-density", type=float, default=0.5, help="TIES density (both)")
    p.add_argument("--ties-weight", type=float, default=1.0, help="TIES weight (both)")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the merge outputs in WORKDIR/out")
    p.add_argument("--generate-only", action="store_true", help="generate inputs and stop")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument(
        "--previous-cli",
        default=None,
        help="another ram-dist (e.g. an older checkout: 'env PYTHONPATH=/tmp/old python -m "
        "ram_dist.cli'), measured as previous:METHOD in the same alternating run",
    )
    p.add_argument(
        "--merge-arg", action="append", default=[], help="extra argument for ram-dist merge"
    )
    p.add_argument(
        "--mergekit-arg", action="append", default=[], help="extra argument for mergekit-yaml"
    )
    p.add_argument(
        "--memory-sizes",
        type=parse_sizes,
        default=[],
        help="also run ram-dist ram_plus once per size (e.g. 0.1e9,1e9) for memory scaling",
    )
    return p.parse_args(argv)


def method_params(args: argparse.Namespace) -> MethodParams:
    return MethodParams(args.r, args.alpha, args.eps, args.ties_density, args.ties_weight)


def model_info(bench: Bench) -> dict[str, Any]:
    models = bench.models
    return {
        "params": models.dims.params,
        "hidden": models.dims.hidden,
        "layers": models.dims.layers,
        "vocab": models.dims.vocab,
        "tensors": models.tensors,
        "shards": len(models.shards),
        "input_bytes": bench.input_bytes,
        "base_bytes": bench.base_bytes,
    }


def compare(args: argparse.Namespace, runs: list[Run], result: dict[str, Any]) -> None:
    """Generate (or reuse) the inputs, measure ``runs``, print and record the results."""
    start = time.perf_counter()
    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    result["generation_s"] = time.perf_counter() - start
    if args.generate_only:
        return
    cli, env = cli_command(args.cli)
    bench = Bench(args, args.workdir, models, method_params(args), cli, env)
    bench.write_mergekit_configs(runs)
    print(f"warming page cache: reading {bench.input_bytes / 2**30:.2f} GiB", flush=True)
    warm_page_cache(models)
    samples, reports = measure_all(bench, runs, args.repeats)
    add_ratios(samples)
    summary = {name: medians(rows) for name, rows in samples.items()}

    info = model_info(bench)
    print(
        f"\nmodel: {info['params'] / 1e9:.3f} B params x 4 checkpoints, "
        f"{info['input_bytes'] / 2**30:.2f} GiB read per pass, base "
        f"{info['base_bytes'] / 2**30:.2f} GiB, {info['shards']} shard(s) each; "
        f"{args.repeats} repeat(s), {cpu_count()} CPUs"
    )
    commands = {run.name: bench.user_command(run) for run in runs}
    for name, command in commands.items():
        print(f"  {name}: {command}")
    print_medians(summary)
    print_samples(samples)
    print_task_stats(reports.get("ramdist:ram_plus", {}))
    result |= {
        "model": info,
        "runs": [run.name for run in runs],
        "commands": commands,
        "argv": {run.name: bench.command(run) for run in runs},
        "mergekit_options": mergekit_options(args),
        "median": summary,
        "samples": samples,
        "last_reports": reports,
    }


def memory_scaling(
    args: argparse.Namespace, sizes: Sequence[float], params: MethodParams
) -> list[dict[str, Any]]:
    """ram-dist ``ram_plus`` once per model size, each in ``WORKDIR/mem-SIZE``."""
    rows: list[dict[str, Any]] = []
    run = Run("ramdist", "ram_plus")
    args = argparse.Namespace(**(vars(args) | {"unit_mb": args.memory_unit_mb}))
    cli, env = cli_command(args.cli)
    for size in sizes:
        sub = args.workdir / f"mem-{size / 1e9:g}B"
        models = ensure_models(sub, size, args.shard_mb * 10**6, args.seed)
        bench = Bench(args, sub, models, params, cli, env)
        warm_page_cache(models)
        sample, _ = bench.measure(run, 1)
        print(f"memory scaling: {size:g} params, {sample['wall_s']:.2f} s", flush=True)
        keys = (
            "wall_s", "units", "worker_peak_rss_bytes", "driver_peak_rss_bytes", "bytes_read",
            "worker_peak_private_bytes", "driver_peak_private_bytes",
        )  # fmt: skip
        row = {"size": size, "params": models.dims.params, "input_bytes": bench.input_bytes}
        rows.append(row | {k: sample.get(k) for k in keys} | {"command": bench.command(run)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = parse_runs(args.runs)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = {"config": config, "cpus": cpu_count()}
    result["method_params"] = vars(method_params(args))
    if runs or args.generate_only:
        compare(args, runs, result)
    if args.memory_sizes and not args.generate_only:
        rows = memory_scaling(args, args.memory_sizes, method_params(args))
        print_memory_scaling(rows, args.memory_unit_mb)
        result["memory_scaling"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
