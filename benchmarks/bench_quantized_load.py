"""RAM's fused kernels on an MXFP4 base read as stored against the same base decoded to bf16,
on whole gpt-oss-shaped experts, without I/O: nanoseconds per value of the count and the
merge (three bf16 tasks, bf16 out), and of `mxfp4.decode_bf16` (the copy the kernels no
longer take). Shapes: the packed [experts, rows, groups, 16] of `bench_mxfp4`'s
`gate_up_proj` (rows 1,408, 22 groups) and of gpt-oss-120b's (rows 5,760, 90 groups), where
a decoded row's nibbles lie 1,440 bytes apart. Each figure is the best of `--repeats`; the
outputs of the two merges are checked to be the same bytes.

    python -m benchmarks.bench_quantized_load --repeats 5

from the repository root.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ram_dist.kernels import mxfp4, quantized, ram_numba

#: (experts, packed rows, groups): bench_mxfp4's gate_up_proj, gpt-oss-120b's.
SHAPES = ((4, 1408, 22), (1, 5760, 90))
EPS = 1e-5


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(experts: int, rows: int, groups: int, repeats: int) -> dict[str, float]:
    """ns per value of each step on one shape."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, experts * rows * groups * 16, dtype=np.uint8)
    scales = rng.integers(115, 125, experts * rows * groups, dtype=np.uint8)
    n = scales.size * mxfp4.GROUP
    base = mxfp4.decode_bf16(blocks, scales, rows, groups, np.empty(n, np.uint16))
    tasks = []
    for _ in range(3):
        t = base.copy()
        t[rng.random(n) < 0.1] += np.uint16(3)
        tasks.append(t)

    def stored() -> quantized.QuantizedValues:
        return quantized.mxfp4_values(blocks, scales, rows, groups)

    decoded, out, ref = (np.empty(n, np.uint16) for _ in range(3))

    def merge(b: Any, into: np.ndarray) -> None:
        ram_numba.merge_ram(b, tasks, EPS, [1.0, 1.0, 1.0], into, bf16_nan=-1)

    steps: dict[str, Callable[[], object]] = {
        "decode_bf16": lambda: mxfp4.decode_bf16(blocks, scales, rows, groups, decoded),
        "count, bf16 base": lambda: ram_numba.overlap_counts(base, tasks, EPS),
        "count, MXFP4 base": lambda: ram_numba.overlap_counts(stored(), tasks, EPS),
        "merge, bf16 base": lambda: merge(base, ref),
        "merge, MXFP4 base": lambda: merge(stored(), out),
    }
    for step in steps.values():  # compile or load, outside the timing
        step()
    if not np.array_equal(out, ref):
        raise SystemExit("the MXFP4 base's merge differs from the bf16 base's")
    return {name: best(step, repeats) / n * 1e9 for name, step in steps.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for experts, rows, groups in SHAPES:
        got = bench(experts, rows, groups, args.repeats)
        print(f"{experts} x [{rows}, {groups}, 16] packed, {rows * groups * 32 * experts:,} values")
        for name, ns in got.items():
            print(f"  {name:<20} {ns:6.2f} ns/value")


if __name__ == "__main__":
    main()
