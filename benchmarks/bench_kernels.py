"""Eager torch vs fused numba RAM kernels on one chunk: elements per second, per pass.

The engine hands a method one chunk at a time; this measures just that step, without I/O:
the reduce pass (`overlap_statistics` vs `overlap_counts`) and the map pass
(`merge_ram(...).to(out_dtype)` vs the fused `merge_ram` writing the output dtype). Inputs
are a synthetic base and RL-like agents (task-vector densities about 3 %, 46 %, 54 %, ...),
drawn by `ram_dist.synthetic` as one flat tensor.
Eager and fused runs alternate, `--repeats` times, with a plain copy of the bytes the passes
read (the base and the agents: one `numpy.copyto`, one thread, so it reads and writes that
many bytes): its rate in the same elements is the CPU's memcpy ceiling, and `of memcpy` is
each fused pass's rate over it. Medians are printed, and the two outputs are checked for byte
equality. With `--compile` (default), the first-call cost of
the kernels is also measured in fresh processes: with an empty numba cache (compilation),
then with the cache that run left (loading).

With `--exact-sums`, it times the exact sums of products instead (`kernels.exact_sums.gram`,
model_stock's round and the geometric methods' norms and dots): the vectorized kernel against
the scalar binning it replaced (`scalar_gram`, kept here), alternating, on the task vectors
of `--tasks` agents (every pair: n(n+1)/2 products per element), on bfloat16 values and on
float32 values, checking that both give the same bins. Rates are products per second of CPU
time (`time.process_time`, one thread), so that a busy machine's waits are not counted.

    python -m benchmarks.bench_kernels --elements 16M --tasks 3 --dtype bf16 --repeats 5
    python -m benchmarks.bench_kernels --exact-sums --elements 4M --tasks 3 --repeats 7

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
from functools import cache
from pathlib import Path

import numpy as np
import torch

from ram_dist.kernels import exact_sums, precision, ram_numba
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

    nbytes = n * dtype.itemsize * (1 + tasks)
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)  # pages touched

    def memcpy() -> None:
        np.copyto(dst, src)

    fused_counts()  # compile (or load from the cache) outside the timings
    fused_merge()
    fused_checked()
    keys = ("ec", "fc", "ek", "fk", "em", "fm", "mc")
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(repeats):
        samples["mc"].append(timed(memcpy))
        samples["ec"].append(timed(eager_counts))
        samples["fc"].append(timed(fused_counts))
        samples["ek"].append(timed(eager_checked))
        samples["fk"].append(timed(fused_checked))
        samples["em"].append(timed(eager_merge))
        samples["fm"].append(timed(fused_merge))
    # the fused counts are a numpy array (a worker on the fused path never imports torch)
    same_counts = torch.equal(holder["eager_counts"], torch.as_tensor(holder["fused_counts"]))
    (eh, ef), (fh, ff) = holder["eager_checked"], holder["fused_checked"]
    same_checked = torch.equal(eh, torch.as_tensor(fh)) and list(ef) == list(ff)
    same_bytes = torch.equal(holder["eager_merge"].view(torch.uint8), out.view(torch.uint8))
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"{n} elements, base + {tasks} tasks, {dtype} -> {out_dtype}, "
        f"median of {repeats} (alternating)"
    )
    copy = n / med["mc"] / 1e6
    print(f"memcpy of the inputs' {nbytes / 2**20:.0f} MiB, one thread: {med['mc']:.4f} s, "
          f"{copy:.1f} Mel/s ({nbytes / med['mc'] / 1e9:.2f} GB/s copied)")  # fmt: skip
    print(f"{'pass':<22}{'eager s':>10}{'fused s':>10}{'eager Mel/s':>13}{'fused Mel/s':>13}"
          f"{'speedup':>9}{'of memcpy':>11}  identical")  # fmt: skip
    for name, e, f, same in (
        ("reduce (counts)", med["ec"], med["fc"], same_counts),
        ("reduce + finite check", med["ek"], med["fk"], same_checked),
        ("map (merge + cast)", med["em"], med["fm"], same_bytes),
    ):
        print(
            f"{name:<22}{e:>10.4f}{f:>10.4f}{n / e / 1e6:>13.1f}{n / f / 1e6:>13.1f}"
            f"{e / f:>8.1f}x{n / f / 1e6 / copy:>10.2f}x  {same}"
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


def scalar_gram(stack: np.ndarray, pairs: np.ndarray, out: np.ndarray) -> None:
    """The exact sums as they were binned before vectorizing: each product's float64 bits
    split into two addends, one scalar add each (`exact_sums_numba._add_products`)."""
    _scalar_kernel()(stack, pairs, exact_sums._SPLIT, exact_sums._POS_INF, out)


@cache
def _scalar_kernel() -> Callable[..., None]:
    """The pre-vectorizing `gram`, compiled here (not cached on disk)."""
    from numba import njit

    from ram_dist.kernels import exact_sums_numba
    from ram_dist.kernels.primitives import OPTIONS

    add_products = exact_sums_numba._add_products

    @njit(**OPTIONS)
    def gram(stack, pairs, split, special, out):  # noqa: ANN001, ANN202  (numba arrays)
        scratch = np.empty(512, dtype=np.float64)
        for lo in range(0, stack.shape[1], 512):
            w = min(512, stack.shape[1] - lo)
            for k in range(pairs.shape[0]):
                i, j = pairs[k, 0], pairs[k, 1]
                for t in range(w):
                    scratch[t] = np.float64(stack[i, lo + t]) * np.float64(stack[j, lo + t])
                add_products(scratch[:w], out[k], split, special)

    return gram


def exact_sums_inputs(n: int, tasks: int, seed: int) -> dict[str, np.ndarray]:
    """float32 rows as the callers hand them to `gram`: model_stock's task vectors of bf16
    agents (`precision.task_vectors`), the agents' own bf16 values (a geometric method's
    norms), and float32 agents' values (two addends per product)."""
    base, agents = make_inputs(n, tasks, torch.bfloat16, seed)
    raw = [x.view(torch.uint16).numpy() for x in (base, *agents)]
    deltas = np.stack(precision.task_vectors(raw)[1])
    values = np.stack([a.float().numpy() for a in agents])
    base32, agents32 = make_inputs(n, tasks, torch.float32, seed)
    wide = np.stack([a.numpy() - base32.numpy() for a in agents32])
    return {"bf16 task vectors": deltas, "bf16 values": values, "fp32 task vectors": wide}


def bench_exact_sums(n: int, tasks: int, repeats: int) -> None:
    pairs = np.array(exact_sums.pairs_of(tasks), dtype=np.int64)
    products = n * len(pairs)
    print(f"exact sums of products: {n} elements, {tasks} rows, {len(pairs)} pairs "
          f"({products} products), CPU time, median of {repeats} (alternating)")  # fmt: skip
    print(f"{'inputs':<20}{'scalar s':>10}{'vector s':>10}{'scalar Gp/s':>13}"
          f"{'vector Gp/s':>13}{'speedup':>9}  same bins")  # fmt: skip
    for name, stack in exact_sums_inputs(n, tasks, seed=0).items():
        small = np.ascontiguousarray(stack[:, :64])
        scalar_gram(small, pairs, np.zeros((len(pairs), exact_sums.BINS), np.int64))
        exact_sums.gram(small, pairs.tolist())  # compile (or load) outside the timings
        samples: dict[str, list[float]] = {"s": [], "v": []}
        for _ in range(repeats):
            old = np.zeros((len(pairs), exact_sums.BINS), np.int64)
            began = time.process_time()
            scalar_gram(stack, pairs, old)
            samples["s"].append(time.process_time() - began)
            began = time.process_time()
            new = exact_sums.gram(stack, pairs.tolist())
            samples["v"].append(time.process_time() - began)
        s, v = (statistics.median(samples[k]) for k in ("s", "v"))
        same = new is not None and np.array_equal(old, new)
        print(f"{name:<20}{s:>10.4f}{v:>10.4f}{products / s / 1e9:>13.3f}"
              f"{products / v / 1e9:>13.3f}{s / v:>8.2f}x  {same}")  # fmt: skip
        for key, values in samples.items():
            print(f"  samples {key}: " + " ".join(f"{x:.4f}" for x in values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", default="16M", help="chunk length, e.g. 16M (default)")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--out-dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--exact-sums", action="store_true", help="time the exact sums of products instead"
    )
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    out_dtype = DTYPES[args.out_dtype] if args.out_dtype else dtype
    torch.set_num_threads(1)  # one Ray worker per core: compare single-threaded
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    if args.exact_sums:
        bench_exact_sums(parse_count(args.elements), args.tasks, args.repeats)
        return
    bench(parse_count(args.elements), args.tasks, dtype, out_dtype, args.repeats)
    if args.compile:
        compile_times(args.tasks, dtype)
        found = ram_numba.fma_instructions()
        print(f"FMA in the kernels compiled here: {found or 'none'}")


if __name__ == "__main__":
    main()
