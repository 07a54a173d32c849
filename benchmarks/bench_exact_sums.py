"""The exact sums of products (`kernels.exact_sums.gram`) before and after a change, on one
core: products per second of CPU time, and their ratio, measured in one run.

`gram` sums every pair of the task vectors of `--tasks` agents exactly (n(n+1)/2 products
per element: model_stock's round, the geometric methods' norms and dot products). Its inputs
here are task vectors (agent less base, float32) of bfloat16, float16 and float32 agents
drawn by `ram_dist.synthetic`. Two worker processes time it, one importing `ram_dist` from
`--before` (a checkout, e.g. main's, only read: its kernels compile into a temporary numba
cache) and one from this checkout, alternating call by call, `NUMBA_NUM_THREADS=1`; each
call's CPU time (`time.process_time`) is counted, so a busy machine's waits are not. Both
must give the same bins.

    python -m benchmarks.bench_exact_sums --before /work/main --elements 4M --repeats 7

from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("bf16", "fp16", "fp32")


def parse_count(text: str) -> int:
    """`4M`, `1G`, `4096` -> elements (binary multiples)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def task_vectors(n: int, tasks: int, dtype: str, seed: int) -> np.ndarray:
    """float32[tasks, n]: each agent's value less the base's, both of `dtype`, as
    `precision.task_vectors` measures them (one rounding to float32)."""
    import torch

    from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

    kind = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    base = base_tensor("chunk", (n,), seed, kind)
    rows = []
    for t in range(tasks):
        agent = task_tensor(base, "chunk", AGENT_DENSITIES[t % len(AGENT_DENSITIES)], seed + t)
        rows.append((agent.float() - base.float()).numpy())
    return np.stack(rows)


def worker(folder: Path) -> None:
    """Time `gram` on the stacks saved in `folder`, one call per line read (an input's
    name): answer the call's CPU seconds and a digest of its bins."""
    from ram_dist.kernels import exact_sums

    stacks = {p.stem: np.load(p) for p in folder.glob("*.npy")}
    for stack in stacks.values():  # compile (or load) outside the timings
        exact_sums.gram(np.ascontiguousarray(stack[:, :64]), exact_sums.pairs_of(len(stack)))
    print("ready", flush=True)
    for line in sys.stdin:
        stack = stacks[line.strip()]
        pairs = exact_sums.pairs_of(len(stack))
        began = time.process_time()
        bins = exact_sums.gram(stack, pairs)
        seconds = time.process_time() - began
        digest = hashlib.sha256(np.ascontiguousarray(bins).tobytes()).hexdigest()[:16]
        print(f"{seconds:.6f} {digest}", flush=True)


def start(root: Path, folder: Path, cache: str | None) -> subprocess.Popen[str]:
    """A worker importing `ram_dist` from `root`."""
    env = dict(os.environ, PYTHONPATH=str(root), NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = cache
    proc = subprocess.Popen(  # noqa: S603  (this interpreter, this file)
        [sys.executable, __file__, "--worker", str(folder)],
        cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def ask(proc: subprocess.Popen[str], name: str) -> tuple[float, str]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    seconds, digest = proc.stdout.readline().split()
    return float(seconds), digest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=False, help="checkout to compare")
    parser.add_argument("--elements", default="4M", help="elements per row, e.g. 4M (default)")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return
    n = parse_count(args.elements)
    pairs = args.tasks * (args.tasks + 1) // 2
    products = n * pairs
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as cache:
        for dtype in DTYPES:
            np.save(Path(folder) / f"{dtype}.npy", task_vectors(n, args.tasks, dtype, seed=0))
        before = start(args.before, Path(folder), cache) if args.before else None
        after = start(REPO_ROOT, Path(folder), None)
        print(f"exact sums of products: {n} elements, {args.tasks} task vectors, {pairs} pairs "
              f"({products} products), CPU seconds a call, median of {args.repeats} "
              f"(alternating), one thread")  # fmt: skip
        print(f"{'task vectors':<14}{'before s':>10}{'after s':>10}{'before Gp/s':>13}"
              f"{'after Gp/s':>12}{'ratio':>8}  same bins")  # fmt: skip
        for dtype in DTYPES:
            samples: dict[str, list[float]] = {"before": [], "after": []}
            digests: dict[str, set[str]] = {"before": set(), "after": set()}
            for _ in range(args.repeats):
                for side, proc in (("before", before), ("after", after)):
                    if proc is not None:
                        seconds, digest = ask(proc, dtype)
                        samples[side].append(seconds)
                        digests[side].add(digest)
            a = statistics.median(samples["after"])
            b = statistics.median(samples["before"]) if before else float("nan")
            same = before is None or digests["before"] == digests["after"]
            same = same and len(digests["after"]) == 1
            print(f"{dtype:<14}{b:>10.4f}{a:>10.4f}{products / b / 1e9:>13.3f}"
                  f"{products / a / 1e9:>12.3f}{b / a:>7.2f}x  {same}")  # fmt: skip
            for side, values in samples.items():
                if values:
                    print(f"  samples {side}: " + " ".join(f"{x:.4f}" for x in values))
        for proc in (before, after):
            if proc is not None:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()


if __name__ == "__main__":
    main()
