"""The first merge after a fresh install against the second: `ram-dist merge` of the demo's
tiny model with RAM+, each round in a numba cache of its own that starts empty.

Two installs are compared, each a round of three commands in a fresh cache directory
(`NUMBA_CACHE_DIR`, which the Ray workers inherit):
- `installed`: the README's install step `python -m ram_dist.kernels.warm` (timed), then the
  first merge and the second;
- `bare`: no warm step: the first merge compiles its kernels in every worker, then the
  second.
The issue's target is the first merge at most 1.2x the second. Each command runs as a
subprocess, timed from outside; the merge's report gives its passes. Prints every sample and
the ratios; `--json FILE` writes them.

    python -m benchmarks.bench_first_merge --rounds 2

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_fixed_cost import merge_sample, timed
from benchmarks.commands import cli_command
from ram_dist.cli.demo import make_demo_inputs

WARM = [sys.executable, "-m", "ram_dist.kernels.warm"]


def install_round(
    warm: bool, cli: list[str], env: dict[str, str], base: str, tasks: list[str], work: Path
) -> dict[str, Any]:
    """One fresh cache: the warm step if `warm`, then two merges; their walls and passes."""
    cache = Path(tempfile.mkdtemp(prefix="numba-", dir=work))
    env = env | {"NUMBA_CACHE_DIR": str(cache)}
    row: dict[str, Any] = {"warm_s": timed([*WARM], env, work) if warm else None}
    for name in ("first", "second"):
        sample = merge_sample(cli, env, base, tasks, work / "out")
        row[f"{name}_wall_s"] = sample["wall_s"]
        row[f"{name}_passes_s"] = sample["passes_s"]
    row["wall_ratio"] = row["first_wall_s"] / row["second_wall_s"]
    row["passes_ratio"] = row["first_passes_s"] / row["second_passes_s"]
    shutil.rmtree(cache, ignore_errors=True)
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of both installs")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli, env = cli_command(args.cli)
    work = Path(tempfile.mkdtemp(prefix="ram-dist-first-"))
    rows: dict[str, list[dict[str, Any]]] = {"installed": [], "bare": []}
    try:
        base, tasks = make_demo_inputs(str(work / "inputs"))
        for round_ in range(args.rounds):
            order = ("installed", "bare") if round_ % 2 == 0 else ("bare", "installed")
            for kind in order:
                row = install_round(kind == "installed", cli, env, base, tasks, work)
                rows[kind].append(row)
                print(f"round {round_ + 1}, {kind}: " + _line(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        kind: {k: statistics.median(r[k] for r in got) for k in ("wall_ratio", "passes_ratio")}
        for kind, got in rows.items()
    }
    for kind, median in summary.items():
        print(f"{kind}, medians: first / second wall {median['wall_ratio']:.2f}x, "
              f"passes {median['passes_ratio']:.2f}x")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": rows, "median": summary}, indent=2))
    return 0


def _line(row: dict[str, Any]) -> str:
    warm = "" if row["warm_s"] is None else f"warm {row['warm_s']:.1f} s, "
    return (
        f"{warm}first merge {row['first_wall_s']:.2f} s (passes {row['first_passes_s']:.2f} s), "
        f"second {row['second_wall_s']:.2f} s (passes {row['second_passes_s']:.2f} s): "
        f"{row['wall_ratio']:.2f}x, passes {row['passes_ratio']:.2f}x"
    )


if __name__ == "__main__":
    raise SystemExit(main())
