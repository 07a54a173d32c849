"""A sweep of RAM+ variants against one merge and against the same merges one at a time, in
one run (issue 44's first target).

Inputs: the bf16 Llama base and three agents of ``benchmarks.inputs`` (``--params`` each,
generated once in ``--workdir`` and reused). Then, ``--repeats`` times, in an order that
rotates by one each repeat:

* ``one``: ``ram-dist merge --method ram_plus`` with RAM+'s defaults (r 0.1, alpha 2);
* ``sweep``: ``ram-dist merge --method ram_plus --grid r=... --grid alpha=...`` (six variants
  by default), its passes and bytes read from ``OUT/sweep_report.json``;
* ``singles`` (with ``--singles``): the sweep's variants as separate merges, one after another;
* ``write``: the floor of writing the outputs the sweep writes beyond one merge's: the base's
  bytes, once per extra variant, with plain buffered writes (no fsync).

Prints the medians, the bytes each read, and the ratios: the sweep's wall over one merge's
wall plus the write floor (target: at most 1.5), and over the singles' (when measured).

Example::

    python -m benchmarks.bench_sweep --params 1e9 --repeats 3 --workdir /tmp/ramdist-bench

from the repository root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from benchmarks.inputs import Models, ensure_models, model_names, safetensors_files
from benchmarks.running import READ_BLOCK, run_process, write_bytes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1e9, help="parameters per checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--r", default="0.05,0.1,0.2", help="the sweep's values of r")
    p.add_argument("--alpha", default="1,2", help="the sweep's values of alpha")
    p.add_argument("--singles", action="store_true", help="also run each variant alone")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _merge(models: Models, out: Path, log: Path, flags: list[str]) -> dict[str, Any]:
    """One `ram-dist merge` (a sweep where `flags` say so): its wall time and its report."""
    cli, env = cli_command(None)
    argv = ["merge", "--base", str(models.folder / "base"), "--out", str(out), "--overwrite"]
    for agent in model_names()[1:]:
        argv += ["--task", str(models.folder / agent)]
    shutil.rmtree(out, ignore_errors=True)
    wall, _ = run_process([*cli, *argv, "--method", "ram_plus", *flags], env, log)
    sweep = out / "sweep_report.json"
    report = json.loads((sweep if sweep.exists() else out / "merge_report.json").read_text())
    passes = report["passes"]
    return {
        "wall_s": wall,
        "passes_s": passes["reduce"]["wall_s"] + passes["map"]["wall_s"],
        "bytes_read": passes["reduce"]["bytes_read"] + passes["map"]["bytes_read"],
    }


def measure(args: argparse.Namespace, models: Models, run: str, repeat: int) -> dict[str, Any]:
    out = args.workdir / "out" / run
    log = args.workdir / f"sweep-{run}_{repeat}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    grid = list(itertools.product(args.r.split(","), args.alpha.split(",")))
    if run == "one":
        return _merge(models, out, log, [])
    if run == "sweep":
        return _merge(models, out, log, ["--grid", f"r={args.r}", "--grid", f"alpha={args.alpha}"])
    if run == "singles":
        each = [_merge(models, out, log, ["--r", r, "--alpha", a]) for r, a in grid]
        return {k: sum(s[k] for s in each) for k in each[0]}
    base_bytes = sum(p.stat().st_size for p in safetensors_files(models.folder / "base"))
    scratch, buf = args.workdir / "write_floor.bin", bytearray(READ_BLOCK)
    start = time.perf_counter()
    for _ in range(len(grid) - 1):
        write_bytes(scratch, base_bytes, buf)
    wall = time.perf_counter() - start
    scratch.unlink()
    return {"wall_s": wall, "passes_s": wall, "bytes_read": 0}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    runs = ["one", "sweep", "write"] + (["singles"] if args.singles else [])
    samples: dict[str, list[dict[str, Any]]] = {run: [] for run in runs}
    for repeat in range(args.repeats):
        for run in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:
            sample = measure(args, models, run, repeat)
            samples[run].append(sample)
            print(f"  {run} #{repeat + 1}: wall {sample['wall_s']:.2f} s, "
                  f"passes {sample['passes_s']:.2f} s, read {sample['bytes_read'] / 1e9:.2f} GB",
                  flush=True)  # fmt: skip
    med = {
        run: {k: statistics.median(s[k] for s in ss) for k in ss[0]} for run, ss in samples.items()
    }
    print(
        f"\n{models.dims.params / 1e9:.2f} B parameters per checkpoint, base and three agents, "
        f"ram_plus over r={args.r} x alpha={args.alpha}, medians of {args.repeats}\n"
    )
    print("| run | wall (s) | passes (s) | bytes read |\n|---|---:|---:|---:|")
    for run, m in med.items():
        print(
            f"| {run} | {m['wall_s']:.2f} | {m['passes_s']:.2f} | {m['bytes_read'] / 1e9:.2f} GB |"
        )
    sweep, one = med["sweep"], med["one"]
    bound = one["wall_s"] + med["write"]["wall_s"]
    print(f"\nsweep wall / (one merge's wall + the write floor): {sweep['wall_s'] / bound:.2f}x")
    print(f"sweep bytes read / one merge's: {sweep['bytes_read'] / one['bytes_read']:.2f}x")
    if "singles" in med:
        print(f"sweep wall / the singles' walls: {sweep['wall_s'] / med['singles']['wall_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
