"""A sweep of many variants against one merge and against the same merges one at a time, in
one run (issue 44's targets).

Inputs: the bf16 Llama base and three agents of ``benchmarks.inputs`` (``--params`` each,
generated once in ``--workdir`` and reused). The sweep is ``--methods`` (a comma list) over
``--grid NAME=V1,V2,...`` (repeatable), as ``ram-dist merge --method M ... --grid ...`` takes
them: each method takes the Cartesian product of the grid names it declares. Default: RAM+
over ``r=0.05,0.1,0.2`` and ``alpha=1,2`` (six variants). Then, ``--repeats`` times, in an
order that rotates by one each repeat:

* ``one``: ``ram-dist merge --method M`` with the first method's defaults;
* ``sweep``: the sweep, its passes and bytes read from ``OUT/sweep_report.json``;
* ``singles`` (with ``--singles``): the sweep's variants as separate merges (each with its
  method and its grid values as flags), one after another, summed;
* ``write``: the floor of writing the outputs the sweep writes beyond one merge's: the base's
  bytes, once per extra variant, with plain buffered writes (no fsync).

Prints every sample, the medians, the bytes each read, and the ratios: the sweep's wall over
one merge's wall plus the write floor (target for six RAM+ variants: at most 1.5), and over
the singles' (target for twelve variants across methods at 3B: at most 0.3).

Examples, from the repository root::

    python -m benchmarks.bench_sweep --params 1e9 --repeats 3 --workdir /tmp/ramdist-bench
    python -m benchmarks.bench_sweep --params 0.5e9 --singles \\
        --methods ram_plus,ties,della,task_arithmetic,model_stock,consensus_ties \\
        --grid r=0.1,0.2 --grid alpha=1,2 --grid density=0.3,0.5

(the second: the issue's twelve variants.)
"""

from __future__ import annotations

import argparse
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

DEFAULT_GRID = ("r=0.05,0.1,0.2", "alpha=1,2")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1e9, help="parameters per checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="ram_plus", help="the sweep's methods, comma-separated")
    p.add_argument(
        "--grid", action="append", metavar="NAME=V1,V2,...",
        help=f"a grid of the sweep (repeatable; default: {' '.join(DEFAULT_GRID)})",
    )  # fmt: skip
    p.add_argument("--singles", action="store_true", help="also run each variant alone")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    args.grid = args.grid or list(DEFAULT_GRID)
    return args


def singles(args: argparse.Namespace, models: Models) -> list[tuple[str, list[str]]]:
    """Each variant of the sweep, as ram-dist names it, and its single merge's flags: its
    method, and each grid value it takes by that parameter's own flag."""
    from ram_dist.planning.config import MergeConfig
    from ram_dist.planning.sweep import declared, variants

    grid = dict(g.split("=", 1) for g in args.grid)
    config = MergeConfig(
        base=str(models.folder / "base"),
        tasks=tuple(str(models.folder / agent) for agent in model_names()[1:]),
        out=str(args.workdir / "out" / "sweep"),
        methods=tuple(args.methods), grid={n: v.split(",") for n, v in grid.items()},
    )  # fmt: skip
    out = []
    for v in variants(config):
        flags = ["--method", v.method]
        for name, value in v.grid.items():
            flag = declared(v.method)[name].cli_flag
            if flag is None:
                raise SystemExit(f"grid {name}: {v.method} takes it in YAML only, no flag")
            flags += [flag, str(value)]
        out.append((v.name, flags))
    return out


def _merge(models: Models, out: Path, log: Path, flags: list[str]) -> dict[str, Any]:
    """One `ram-dist merge` (a sweep where `flags` say so): its wall time and its report."""
    cli, env = cli_command(None)
    argv = ["merge", "--base", str(models.folder / "base"), "--out", str(out), "--overwrite"]
    for agent in model_names()[1:]:
        argv += ["--task", str(models.folder / agent)]
    shutil.rmtree(out, ignore_errors=True)
    wall, _ = run_process([*cli, *argv, *flags], env, log)
    sweep = out / "sweep_report.json"
    report = json.loads((sweep if sweep.exists() else out / "merge_report.json").read_text())
    passes = report["passes"]
    shutil.rmtree(out, ignore_errors=True)  # the disk holds one run's outputs at a time
    return {
        "wall_s": wall,
        "passes_s": passes["reduce"]["wall_s"] + passes["map"]["wall_s"],
        "bytes_read": passes["reduce"]["bytes_read"] + passes["map"]["bytes_read"],
    }


def measure(
    args: argparse.Namespace, models: Models, run: str, repeat: int, variants: list[Any]
) -> dict[str, Any]:
    out = args.workdir / "out" / run
    log = args.workdir / f"sweep-{run}_{repeat}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    if run == "one":
        return _merge(models, out, log, ["--method", args.methods[0]])
    if run == "sweep":
        flags = [f for m in args.methods for f in ("--method", m)]
        return _merge(models, out, log, [*flags, *(f for g in args.grid for f in ("--grid", g))])
    if run == "singles":
        each = []
        for name, flags in variants:
            each.append(_merge(models, out, log, flags))
            print(f"    {name}: wall {each[-1]['wall_s']:.2f} s", flush=True)
        return {k: sum(s[k] for s in each) for k in each[0]}
    base_bytes = sum(p.stat().st_size for p in safetensors_files(models.folder / "base"))
    scratch, buf = args.workdir / "write_floor.bin", bytearray(READ_BLOCK)
    start = time.perf_counter()
    for _ in range(len(variants) - 1):
        write_bytes(scratch, base_bytes, buf)
    wall = time.perf_counter() - start
    scratch.unlink()
    return {"wall_s": wall, "passes_s": wall, "bytes_read": 0}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    variants = singles(args, models)
    print(f"{len(variants)} variants: {', '.join(name for name, _ in variants)}", flush=True)
    runs = ["one", "sweep", "write"] + (["singles"] if args.singles else [])
    samples: dict[str, list[dict[str, Any]]] = {run: [] for run in runs}
    for repeat in range(args.repeats):
        for run in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:
            sample = measure(args, models, run, repeat, variants)
            samples[run].append(sample)
            print(f"  {run} #{repeat + 1}: wall {sample['wall_s']:.2f} s, "
                  f"passes {sample['passes_s']:.2f} s, read {sample['bytes_read'] / 1e9:.2f} GB",
                  flush=True)  # fmt: skip
    med = {
        run: {k: statistics.median(s[k] for s in ss) for k in ss[0]} for run, ss in samples.items()
    }
    print(
        f"\n{models.dims.params / 1e9:.2f} B parameters per checkpoint, base and three agents, "
        f"{len(variants)} variants: --method {' --method '.join(args.methods)} "
        f"--grid {' --grid '.join(args.grid)}, medians of {args.repeats}\n"
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
        each = med["singles"]
        print(f"sweep wall / the singles' walls: {sweep['wall_s'] / each['wall_s']:.2f}x")
        print(f"sweep bytes read / the singles': {sweep['bytes_read'] / each['bytes_read']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
