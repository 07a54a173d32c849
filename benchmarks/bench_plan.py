"""Wall time and peak memory of ``ram-dist plan`` on a Llama-3.1-405B base and three tasks.

Writes, in a temporary folder, four checkpoints with the real Llama-3.1-405B layout (126
layers, hidden 16384, 128 heads, 8 KV heads, intermediate 53248, vocab 128256, untied
``lm_head``, bf16; Hugging Face ``LlamaForCausalLM`` names) in 191 shards each with a
``model.safetensors.index.json``, as sparse files: each shard's real safetensors header,
then ``truncate`` to its full size (about 4.2 GB of holes, no data). Then it runs
``ram-dist plan --base B --task T1 --task T2 --task T3 --unit-mb 256`` as a subprocess and
prints its wall time, CPU time and peak RSS (``os.wait4``) as a Markdown table, beside the
same for a bare import of ram-dist's modules (what every command pays first). Target: at most
5 s and 1 GiB. Every tensor-free step of a merge is in it: listing, index and header reads,
the checks, the layout, the plan of the work units. The shards hold consecutive tensors,
about equal in bytes (the real checkpoint's exact split differs a little).

Example::

    python -m benchmarks.bench_plan --repeats 3
    python -m benchmarks.bench_plan --profile /tmp/plan.prof   # then: python -m pstats ...

from the repository root. The layout and the sparse files are `ram_dist.synthetic`'s.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.commands import cli_command
from benchmarks.running import run_process
from ram_dist.io.checkpoint import INDEX_NAME
from ram_dist.synthetic.files import write_sparse_checkpoint
from ram_dist.synthetic.llama import LLAMA_3_1_405B

SHARDS = 191
ROLES = ("base", "task1", "task2", "task3")
Tensors = list[tuple[str, tuple[int, ...]]]
#: What every `ram-dist` command imports before it does anything (torch, Ray, numba).
IMPORTS = "import ram_dist.cli, ram_dist.engine.driver, ram_dist.report"


def shard(tensors: Tensors) -> list[Tensors]:
    """`SHARDS` shards of consecutive tensors, about equal in bytes: a tensor goes to the shard
    its first byte falls in. No tensor is larger than a shard's share, so none is empty."""
    sizes = [2 * math.prod(shape) for _, shape in tensors]
    total = sum(sizes)
    shards: list[Tensors] = [[] for _ in range(SHARDS)]
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        shards[min(SHARDS - 1, offset * SHARDS // total)].append(tensor)
        offset += size
    if not all(shards):
        raise RuntimeError("an empty shard: the layout does not fit the shard count")
    return shards


def _measure(cmd: list[str], env: dict[str, str], log: Path) -> list[float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS MiB of one run of `cmd`."""
    wall, usage = run_process(cmd, env, log)
    return [wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024]  # maxrss: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--repeats", type=int, default=3, help="runs of `ram-dist plan` (3)")
    parser.add_argument("--unit-mb", default="256", help="`--unit-mb` of the plan (256)")
    parser.add_argument("--cli", help='run this instead of ram-dist (e.g. "env PYTHONPATH=...")')
    parser.add_argument("--profile", help="run once more under cProfile, writing this file")
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plan-"))
    try:
        shards = shard(LLAMA_3_1_405B.tensors())
        folders = [root / role for role in ROLES]
        if not all((f / INDEX_NAME).exists() for f in folders):  # else: written by an earlier run
            for f in folders:
                shutil.rmtree(f, ignore_errors=True)
                write_sparse_checkpoint(f, shards)
        paths = [p for f in folders for p in f.glob("*.safetensors")]
        files, logical = len(paths), sum(p.stat().st_size for p in paths)
        cmd, env = cli_command(args.cli)
        argv = ["plan", "--base", str(folders[0])]
        for f in folders[1:]:
            argv += ["--task", str(f)]
        argv += ["--unit-mb", args.unit_mb]
        imports = None if args.cli else [sys.executable, "-c", IMPORTS]
        rows: list[list[float]] = []
        for k in range(args.repeats):
            row = _measure([*cmd, *argv], env, root / f"plan-{k}.log")
            if imports is not None:
                row += _measure(imports, env, root / f"imports-{k}.log")
            rows.append(row)
        if args.profile:
            if args.cli:
                raise SystemExit("--profile runs this interpreter's ram_dist; drop --cli")
            profiled = [sys.executable, "-m", "cProfile", "-o", os.path.abspath(args.profile)]
            run_process([*profiled, "-m", "ram_dist.cli", *argv], env, root / "plan-profile.log")
        print(
            f"Llama-3.1-405B layout, base + 3 tasks: {files} files, "
            f"{logical / 1e12:.2f} TB logical (sparse), `--unit-mb {args.unit_mb}`\n"
        )
        print(
            "| run | `plan` wall s | CPU s | peak RSS MiB "
            "| imports only: wall s | CPU s | peak RSS MiB |"
        )
        print("|---|---|---|---|---|---|---|")
        medians = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
        for name, row in [*((str(k), r) for k, r in enumerate(rows, start=1)), ("median", medians)]:
            cells = [f"{v:.0f}" if i % 3 == 2 else f"{v:.2f}" for i, v in enumerate(row)]
            print(f"| {name} | " + " | ".join(cells + ["-"] * (6 - len(cells))) + " |")
        print()
        for line in (root / "plan-0.log").read_text().splitlines():
            if line.startswith(("tensors:", "work units:")):
                print(line)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
