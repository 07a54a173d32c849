"""What the first reduce round's precision check costs: RAM's count kernel alone, the same
kernel with the check in its sweep (what a merge runs on a float32 or FP8 base), and the
check's own kernel (what the other methods run), on one chunk, in one run.

The base is fine-grained FP8 (e4m3 bytes, one float32 scale per 128 x 128 block, read as
stored) or float32; the agents are bfloat16 (the base cast, as `transformers` loads it, with
`--changed` of the elements moved by one bf16 unit in the last place) or float32 (the same
values widened: the check then compares them with the base rounded to bf16 and fp16). The
configurations alternate, `--repeats` times; the medians and their ratios are printed.

    python -m benchmarks.bench_precision_check --elements 16M --tasks 3 --repeats 7

from the repository root.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from benchmarks.bench_kernels import parse_count
from ram_dist.kernels import fp8, precision, precision_numba, ram_numba

EPS = 1e-5
BLOCK = (128, 128)


def inputs(n: int, tasks: int, base_kind: str, task_kind: str, changed: float, seed: int = 0):
    """The base (FP8 as stored, or float32) and the agents, as the engine hands them."""
    rng = np.random.default_rng(seed)
    cols = 4096
    rows = -(-n // cols)
    if base_kind == "fp8":
        q = rng.integers(0, 256, rows * cols, dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x10  # no NaN codes
        per = -(-rows // BLOCK[0]) * -(-cols // BLOCK[1])
        scales = (rng.random(per) * 1e-3 + 1e-4).astype(np.float32)
        base = fp8.Fp8Values(q, scales, cols, BLOCK)
        values = fp8.dequantize(q, scales, cols, BLOCK, np.empty(q.size, np.float32))
    else:
        values = (rng.standard_normal(rows * cols) * 0.02).astype(np.float32)
        base = values
    cast = (precision.rounded(values, "BF16").view(np.uint32) >> 16).astype(np.uint16)
    agents = []
    for _ in range(tasks):
        agent = cast.copy()
        moved = rng.random(agent.size) < changed
        agent[moved] += np.uint16(1)  # one bf16 ulp
        agents.append(agent if task_kind == "bf16" else precision.as_float32(agent).copy())
    return base, agents


def median_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each configuration's median wall time, alternating (after one untimed call each)."""
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", default="16M", help="chunk length, e.g. 16M (default)")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--changed", type=float, default=0.01, help="share each agent moves")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    n = parse_count(args.elements)
    print(f"{n} elements, {args.tasks} agents, {args.changed:.0%} moved; medians of "
          f"{args.repeats}, ns per element")  # fmt: skip
    print(f"{'base':>6} {'agents':>7} {'count':>7} {'count+check':>12} {'check':>7} "
          f"{'(count+check)/count':>20}")  # fmt: skip
    for base_kind, task_kind in (("fp8", "bf16"), ("fp8", "f32"), ("f32", "bf16")):
        base, agents = inputs(n, args.tasks, base_kind, task_kind, args.changed)
        every = [base, *agents]
        runs = {
            "count": partial(ram_numba.overlap_counts_nonfinite, base, agents, EPS),
            "count+check": partial(ram_numba.overlap_counts_checked, base, agents, EPS),
            "check": partial(precision_numba.check_counts, every, EPS),
        }
        got = median_seconds(runs, args.repeats)
        ns = {k: v / n * 1e9 for k, v in got.items()}
        print(f"{base_kind:>6} {task_kind:>7} {ns['count']:7.2f} {ns['count+check']:12.2f} "
              f"{ns['check']:7.2f} {got['count+check'] / got['count']:19.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
