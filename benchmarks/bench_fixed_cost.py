"""The fixed cost of a merge: `ram-dist merge` of the demo's tiny model, end to end, beside
Ray's own start and stop (a bare `ray.init(); ray.shutdown()` in a fresh Python) on the same
machine, in alternating rounds; what the merge costs beyond Ray's share is ours.

Each command runs as a subprocess, timed from outside (start to exit). The merge's own report
gives its passes and their timelines (when the worker got its first task: worker start-up
inside the passes). Prints every sample and the medians; `--json FILE` writes them.

    python -m benchmarks.bench_fixed_cost --rounds 5

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from ram_dist.cli.demo import make_demo_inputs

#: What a bare Ray costs: started as `ram-dist` starts its embedded one, and stopped.
BARE_RAY = (
    "import logging, ray; "
    "ray.init(address='local', include_dashboard=False, logging_level=logging.WARNING); "
    "ray.shutdown()"
)


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds from start to exit of `argv`, run in `cwd` (not the caller's folder, where
    `python -m` would find the checkout before a `PYTHONPATH` given with `--cli`); raise if
    it fails."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return took


def merge_sample(cli: list[str], env: dict[str, str], base: str, tasks: list[str],
                 out: Path) -> dict[str, Any]:  # fmt: skip
    """One demo merge: its wall time and, from its report, its passes and when their first
    tasks started."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [*cli, "merge", "--base", base, "--out", str(out), "--method", "ram_plus"]
    for task in tasks:
        argv += ["--task", task]
    wall = timed(argv, env, out.parent)
    report = json.loads((out / "merge_report.json").read_text())
    passes = report["passes"]
    sample: dict[str, Any] = {"wall_s": wall}
    for name, p in passes.items():
        sample[f"{name}_s"] = p["wall_s"]
        line = p.get("timeline") or {}
        rows = line.get("workers") or []
        if rows:  # the first task of the pass: how long the workers left it waiting
            sample[f"{name}_first_task_s"] = min(r["before_first_s"] for r in rows)
    sample["passes_s"] = sum(p["wall_s"] for p in passes.values())
    return sample


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (after a warm-up)")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli, env = cli_command(args.cli)
    work = Path(tempfile.mkdtemp(prefix="ram-dist-fixed-"))
    try:
        base, tasks = make_demo_inputs(str(work / "inputs"))
        ray_s: list[float] = []
        merges: list[dict[str, Any]] = []
        for round_ in range(args.rounds + 1):  # round 0 warms the caches, and is left out
            first_ray = round_ % 2 == 0
            for what in ("ray", "merge") if first_ray else ("merge", "ray"):
                if what == "ray":
                    took = timed([sys.executable, "-c", BARE_RAY], env, work)
                    if round_:
                        ray_s.append(took)
                else:
                    sample = merge_sample(cli, env, base, tasks, work / "out")
                    if round_:
                        merges.append(sample)
            if round_:
                print(f"round {round_}: ray {ray_s[-1]:.2f} s, merge {merges[-1]['wall_s']:.2f} s "
                      f"(passes {merges[-1]['passes_s']:.2f} s)", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {k: statistics.median(m[k] for m in merges if k in m) for k in merges[0]}
    median["ray_s"] = statistics.median(ray_s)
    median["beyond_ray_s"] = median["wall_s"] - median["ray_s"]
    print("\nmedians: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"ray_s": ray_s, "merges": merges, "median": median},
                                        indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
