"""Build numba's disk cache for the fused kernels, so that jobs load them instead of compiling.

    python -m ram_dist.kernels.warm [--cache-dir DIR]

Every `@njit(cache=True)` kernel compiles one specialization per argument types, a second or
a few each, in every worker process that finds it in no cache (loading one takes about
10 ms). The kernels that read a merge's inputs take them as records (`views.kernel_inputs`:
one int64 table, whatever the inputs' dtypes, stored forms and count, and one record for the
output, whatever its dtype), so each of them has one specialization; the others are typed by
their arrays: the finiteness scan per width, the LoRA product per pair of dtypes, the exact
sums of products, arcee_fusion's histograms, and MXFP4's and packed INT4/INT8's decoding
(the eager path's). This calls every kernel through its public wrapper, on tiny inputs, so
that the signatures are exactly those a job meets: 33 specializations in all (about a
minute on one core of the development machine). Each kernel module declares its kernels'
calls in a function `warm_calls()`, which this collects (`calls`).

The cache goes where numba puts it: `--cache-dir` (or `NUMBA_CACHE_DIR`), else `__pycache__`
beside the kernel modules when that is writable, else numba's user-wide cache directory
(`~/.cache/numba`), else a directory in the temp dir (`ram_dist.kernels.use_writable_cache`).
Entries are keyed on the kernel source and on the CPU (model name and features): on another
CPU a job compiles again. Prints, per kernel, what was compiled and what loaded; exits 1 if
a call failed, 2 if numba would not cache into `--cache-dir`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from ram_dist.kernels import Call

EPS = 1e-5
N = 16  # elements per input


def calls() -> Iterator[Call]:
    """Every specialization to warm: each kernel module declares its own kernels' calls, as a
    function `warm_calls()` (a new kernel edits only its module); this collects them, module
    by module in alphabetical order."""
    import ram_dist.kernels as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        declared = getattr(module, "warm_calls", None)
        if declared is not None:
            yield from declared()


def name_of(kernel: Any) -> str:
    """A kernel's name, `module.function`, as warm prints it."""
    return f"{kernel.py_func.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}"


def dispatchers() -> dict[str, Any]:
    """Every kernel that declares a warm-up (a numba dispatcher) by name, in `calls()` order
    (nothing is compiled)."""
    return {name_of(kernel): kernel for kernel, _, _ in calls()}


def sample() -> tuple[Any, list[Any], Any]:
    """The record kernels' tiny inputs: a bfloat16 base, one task and an output (each record
    kernel has one signature whatever the dtypes and count)."""
    import torch

    base = torch.zeros(N, dtype=torch.bfloat16)
    return base, [torch.zeros_like(base)], torch.empty(N, dtype=torch.bfloat16)


def warm(cache_dir: str | None = None) -> int:
    """Compile or load every specialization, printing a line per kernel; the exit code."""
    registered = list(calls())
    found = {name_of(kernel): kernel for kernel, _, _ in registered}
    paths = {k.stats.cache_path for k in found.values()}
    for path in sorted(paths):
        print(f"numba cache: {path}", flush=True)
    if cache_dir is not None:
        root = os.path.join(os.path.abspath(cache_dir), "")
        elsewhere = sorted(p for p in paths if not os.path.abspath(p).startswith(root))
        if elsewhere:
            why = f"not a writable directory? numba would use {elsewhere[0]}"
            print(f"error: numba cannot cache into {cache_dir} ({why})", file=sys.stderr)
            return 2
    seconds = dict.fromkeys(found, 0.0)
    failed = 0
    start = time.perf_counter()
    for kernel, label, call in registered:
        began = time.perf_counter()
        try:
            call()
        except Exception as exc:  # report every failure, then exit non-zero
            what = f"{name_of(kernel)} [{label}]: {type(exc).__name__}: {exc}"
            print(f"FAILED {what}", file=sys.stderr)
            failed += 1
        seconds[name_of(kernel)] += time.perf_counter() - began
    total = 0
    for name, kernel in found.items():
        compiled = sum(kernel.stats.cache_misses.values())
        loaded = sum(kernel.stats.cache_hits.values())
        total += compiled + loaded
        print(f"{name:<28}{compiled:>4} compiled {loaded:>4} loaded {seconds[name]:>8.1f} s")
    elapsed = time.perf_counter() - start
    print(f"{total} specializations in {elapsed:.1f} s; {failed} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ram_dist.kernels.warm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cache-dir", help="numba's cache directory (sets NUMBA_CACHE_DIR)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cache_dir is not None:
        os.environ["NUMBA_CACHE_DIR"] = args.cache_dir  # read when numba is first imported
    return warm(args.cache_dir)


if __name__ == "__main__":
    sys.exit(main())
