"""Eager torch vs fused numba RAM kernels on one chunk: elements per second, per pass.

The engine hands a method one chunk at a time; this measures just that step, without I/O:
the reduce pass (`overlap_statistics` vs `overlap_counts`) and the map pass
(`merge_ram(...).to(out_dtype)` vs the fused `merge_ram` writing the output dtype). Inputs
are a synthetic base and RL-like agents (task-vector densities about 3 %, 46 %, 54 %, ...),
drawn by `ram_dist.synthetic` as one flat tensor.
Eager and fused runs alternate, `--repeats` times; medians are printed, and the two
outputs are checked for byte equality. With `--compile` (default), the first-call cost of
the kernels is also measured in fresh processes: with an empty numba cache (compilation),
then with the cache that run left (loading).

    python -m benchmarks.bench_kernels --elements 16M --tasks 3 --dtype bf16 --repeats 5

from the repository root.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ram_dist.kernels import ram_numba
from ram_dist.methods import ram
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DENSITIES = AGENT_DENSITIES + (0.2, 0.1, 0.3, 0.05, 0.6)
EPS = 1e-5


def parse_count(text: str) -> int:
    """`16M`, `1G`, `4096` -> elements (binary multiples)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def make_inputs(
    n: int, tasks: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A base and `tasks` agents whose changes survive rounding to `dtype` and exceed eps."""
    base = base_tensor("chunk", (n,), seed, dtype)
    agents = [
        task_tensor(base, "chunk", DENSITIES[t % len(DENSITIES)], seed + 1 + t)
        for t in range(tasks)
    ]
    return base, agents


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(n: int, tasks: int, dtype: torch.dtype, out_dtype: torch.dtype, repeats: int) -> None:
    base, agents = make_inputs(n, tasks, dtype, seed=0)
    lambdas = [ram.to_float32(1.0 + 0.1 * (t % 3) / 2) for t in range(tasks)]
    out = torch.empty(n, dtype=out_dtype)
    holder: dict[str, torch.Tensor] = {}

    def eager_counts() -> None:
        holder["eager_counts"] = ram.overlap_statistics(base, agents, EPS)

    def fused_counts() -> None:
        holder["fused_counts"] = ram_numba.overlap_counts(base, agents, EPS)

    def eager_checked() -> None:
        finite = [int((~torch.isfinite(x)).sum()) for x in (base, *agents)]
        holder["eager_checked"] = (ram.overlap_statistics(base, agents, EPS), finite)

    def fused_checked() -> None:
        holder["fused_checked"] = ram_numba.overlap_counts_nonfinite(base, agents, EPS)

    def eager_merge() -> None:
        holder["eager_merge"] = ram.merge_ram(base, agents, EPS, lambdas).to(out_dtype)

    def fused_merge() -> None:
        ram_numba.merge_ram(base, agents, EPS, lambdas, out)

    fused_counts()  # compile (or load from the cache) outside the timings
    fused_merge()
    fused_checked()
    samples: dict[str, list[float]] = {k: [] for k in ("ec", "fc", "ek", "fk", "em", "fm")}
    for _ in range(repeats):
        samples["ec"].append(timed(eager_counts))
        samples["fc"].append(timed(fused_counts))
        samples["ek"].append(timed(eager_checked))
        samples["fk"].append(timed(fused_checked))
        samples["em"].append(timed(eager_merge))
        samples["fm"].append(timed(fused_merge))
    same_counts = torch.equal(holder["eager_counts"], holder["fused_counts"])
    (eh, ef), (fh, ff) = holder["eager_checked"], holder["fused_checked"]
    same_checked = torch.equal(eh, fh) and ef == ff
    same_bytes = torch.equal(holder["eager_merge"].view(torch.uint8), out.view(torch.uint8))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"{n} elements, base + {tasks} tasks, {dtype} -> {out_dtype}, "
        f"median of {repeats} (alternating)"
    )
    print(f"{'pass':<22}{'eager s':>10}{'fused s':>10}{'eager Mel/s':>13}{'fused Mel/s':>13}"
          f"{'speedup':>9}  identical")  # fmt: skip
    for name, e, f, same in (
        ("reduce (counts)", med["ec"], med["fc"], same_counts),
        ("reduce + finite check", med["ek"], med["fk"], same_checked),
        ("map (merge + cast)", med["em"], med["fm"], same_bytes),
    ):
        print(
            f"{name:<22}{e:>10.4f}{f:>10.4f}{n / e / 1e6:>13.1f}{n / f / 1e6:>13.1f}"
            f"{e / f:>8.1f}x  {same}"
        )
    for key, values in samples.items():
        print(f"  samples {key}: " + " ".join(f"{v:.4f}" for v in values))


COMPILE_PROBE = """
import time, torch
t0 = time.perf_counter()
from ram_dist.kernels import ram_numba as k
t1 = time.perf_counter()
x = [torch.zeros(8, dtype=torch.{dtype}) for _ in range({inputs})]
k.overlap_counts(x[0], x[1:], 1e-5)
t2 = time.perf_counter()
k.merge_ram(x[0], x[1:], 1e-5, [1.0] * {tasks}, torch.empty(8, dtype=torch.{dtype}))
t3 = time.perf_counter()
print(f"{{t1 - t0:.3f}} {{t2 - t1:.3f}} {{t3 - t2:.3f}}")
"""


def compile_times(tasks: int, dtype: torch.dtype) -> None:
    """First-call cost in fresh processes: cold numba cache, then the cache it left."""
    code = COMPILE_PROBE.format(dtype=str(dtype).split(".")[1], inputs=tasks + 1, tasks=tasks)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(REPO_ROOT)}
        print(f"first call, fresh process, {dtype}, {tasks} tasks (import, counts, merge s):")
        for label in ("empty cache (compile)", "warm cache (load)"):
            result = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            print(f"  {label:<24}{result.stdout.strip()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", default="16M", help="chunk length, e.g. 16M (default)")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out-dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    out_dtype = DTYPES[args.out_dtype] if args.out_dtype else dtype
    torch.set_num_threads(1)  # one Ray worker per core: compare single-threaded
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    bench(parse_count(args.elements), args.tasks, dtype, out_dtype, args.repeats)
    if args.compile:
        compile_times(args.tasks, dtype)
        found = ram_numba.fma_instructions()
        print(f"FMA in the kernels compiled here: {found or 'none'}")


if __name__ == "__main__":
    main()
