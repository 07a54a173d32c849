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
that the signatures are exactly those a job meets: 26 specializations in all (about a
minute on one core of the development machine).

The cache goes where numba puts it: `--cache-dir` (or `NUMBA_CACHE_DIR`), else `__pycache__`
beside the kernel modules when that is writable, else numba's user-wide cache directory
(`~/.cache/numba`), else a directory in the temp dir (`ram_dist.kernels.use_writable_cache`).
Entries are keyed on the kernel source and on the CPU (model name and features): on another
CPU a job compiles again. Prints, per kernel, what was compiled and what loaded; exits 1 if
a call failed, 2 if numba would not cache into `--cache-dir`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from ram_dist.dtypes import INFO
from ram_dist.kernels import READS

#: The label of FP8 output (e4m3 bytes and block scales written by RAM's merge).
FP8 = "fp8"
EPS = 1e-5
N = 16  # elements per input


def dispatchers() -> dict[str, Any]:
    """Every cached kernel (a numba dispatcher) by name, `module.function`."""
    from ram_dist.kernels import (
        arcee_numba,
        blend_numba,
        column_sums_numba,
        della_numba,
        exact_sums_numba,
        int_packed_numba,
        lora_numba,
        mxfp4_numba,
        precision_numba,
        ram_numba,
        scan_numba,
        sce_numba,
        ties_numba,
    )

    found = (
        ram_numba._count_kernel, ram_numba._merge_kernel, ram_numba._merge_fp8_kernel,
        ties_numba._stats_kernel, ties_numba._merge_kernel, scan_numba._count,
        lora_numba.lora_values, exact_sums_numba.gram, exact_sums_numba.row_gram,
        column_sums_numba.column_gram, blend_numba._blend_kernel, blend_numba._stock_kernel,
        della_numba._stats_kernel, della_numba._merge_kernel, precision_numba._check_kernel,
        sce_numba._merge_kernel, arcee_numba._importance_kernel, arcee_numba._merge_kernel,
        arcee_numba._histogram_kernel,
        mxfp4_numba._decode, int_packed_numba._decode,
    )  # fmt: skip
    return {f"{k.py_func.__module__.rsplit('.', 1)[-1]}.{k.__name__}": k for k in found}


def calls() -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """(dispatcher, label, call) for every specialization to warm: one call per kernel that
    takes its inputs and output as records (`views.kernel_inputs`, whatever their dtypes,
    formats and count), then the few kernels typed by their arrays."""
    import torch

    from ram_dist.kernels import fp8, lora_numba, precision_numba, ram_numba, scan_numba

    base = torch.zeros(N, dtype=torch.bfloat16)
    agents = [torch.zeros_like(base)]
    out = torch.empty(N, dtype=torch.bfloat16)
    counts = partial(ram_numba.overlap_counts_nonfinite, base, agents, EPS)
    yield ram_numba._count_kernel, "records", counts
    yield ram_numba._merge_kernel, "records", partial(
        ram_numba.merge_ram, base, agents, EPS, [1.0], out
    )  # fmt: skip
    yield precision_numba._check_kernel, "records", partial(
        precision_numba.check_counts, [base, *agents], EPS
    )  # fmt: skip
    fp8_base = fp8.Fp8Values(np.zeros(N, np.uint8), np.ones(4, np.float32), 4, (2, 2))
    scales = np.ones(4, np.float32).view(np.uint8)
    target = fp8.Fp8Target(np.empty(N, np.uint8), "F32", scales, np.empty_like(scales))
    to_fp8 = partial(ram_numba.merge_ram_fp8, fp8_base, [fp8_base], EPS, [1.0], target)
    yield ram_numba._merge_fp8_kernel, f"records -> {FP8}", to_fp8
    yield from _method_calls(base, agents, "records", out)
    # The finiteness scan reads raw bits: one specialization per width (float64 included).
    for name in ("bfloat16", "float32", "float64"):
        x = torch.zeros(N, dtype=getattr(torch, name))
        yield scan_numba._count, name, partial(scan_numba.nonfinite_count, x)
    # A LoRA task's values: in the base's dtype, and bfloat16 over an FP8 base's float32
    # (typed arrays: its spans of 256 columns measured 10% slower taken as records).
    for theta, to in [*((d, d) for d in READS), ("F32", "BF16")]:
        yield lora_numba.lora_values, f"LoRA {theta} -> {to}", partial(_lora, theta, to)
    # Exact sums of products (the geometric methods' norms and dot products): float32 only.
    from ram_dist.kernels import exact_sums, exact_sums_numba

    vectors = np.zeros((2, N), np.float32)
    pairs = exact_sums.pairs_of(2)
    yield exact_sums_numba.gram, "exact sums", partial(exact_sums.gram, vectors, pairs)
    rows = partial(exact_sums.row_gram, vectors, pairs, N // 2)
    yield exact_sums_numba.row_gram, "exact sums per row", rows
    # arcee_fusion's histograms of its importances (one signature: float32 in)
    from ram_dist.kernels import arcee_numba

    histograms = partial(arcee_numba.histogram, np.zeros(N, np.float32), [0])
    yield arcee_numba._histogram_kernel, "arcee_fusion histograms", histograms
    # nuslerp's sums per column (its compact limbs)
    from ram_dist.kernels import column_sums, column_sums_numba

    by_column = partial(column_sums.fused_column_sums, vectors, pairs, N // 2)
    yield column_sums_numba.column_gram, "exact sums per column", by_column
    # gpt-oss's MXFP4 weights decoded (one signature: bytes in, bfloat16 bits out)
    from ram_dist.kernels import mxfp4_numba

    codes, exponents = np.zeros(2 * 16, np.uint8), np.full(2, 127, np.uint8)
    decode = partial(mxfp4_numba.decode_bf16, codes, exponents, 2, 1, np.empty(64, np.uint16))
    yield mxfp4_numba._decode, "MXFP4", decode
    # compressed-tensors' packed INT4/INT8 weights decoded (one signature: bytes in, 16-bit
    # bits out)
    from ram_dist.kernels import int_packed_numba

    packed = partial(
        int_packed_numba.decode_16, np.zeros(16, np.uint8), 4, 32, np.ones((1, 1), np.float32),
        None, int_packed_numba.BF16, np.empty(32, np.uint16),
    )  # fmt: skip
    yield int_packed_numba._decode, "INT4/INT8", packed


def _method_calls(
    base: Any, agents: list[Any], label: str, out: Any
) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """The kernels of the methods other than RAM, once each (one model: arcee_fusion's
    take one task): TIES's and DELLA's statistics and merges, arcee_fusion's importances
    and selection, the geometric methods' blend, model_stock's and sce's merges."""
    from ram_dist.kernels import arcee_numba, blend_numba, della_numba, sce_numba, ties_numba

    n, size = len(agents), int(base.numel())
    ties_args = dict(
        weights=[1.0] * n, keep=[ties_numba.KEEP_ALL] * n, cuts=[(-1, -1)] * n, start=0,
        consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
    )  # fmt: skip
    della_args = dict(
        start=0, groups=(size, 1), stream_keys=[1] * n, densities=[0.5] * n, epsilons=[0.1] * n
    )  # fmt: skip
    stats = partial(ties_numba.statistics, base, agents, ties_numba.HIGH, 1 << 15)
    yield ties_numba._stats_kernel, label, stats
    della_stats = partial(della_numba.statistics, base, agents, **della_args)
    yield della_numba._stats_kernel, label, della_stats
    imp = partial(arcee_numba.importance, base, agents[0], 4)  # rows of 4
    yield arcee_numba._importance_kernel, label, imp
    ties = partial(ties_numba.merge, base, agents, out, **ties_args)
    yield ties_numba._merge_kernel, label, ties
    # the geometric methods' blend (its mode is a value: one signature)
    mix = partial(blend_numba.blend, base, agents, out, mode=blend_numba.MODELS, factors=[1.0] * n)
    yield blend_numba._blend_kernel, label, mix
    della = partial(
        della_numba.merge, base, agents, out, **della_args, factors=[None] * n,
        weights=[1.0] * n, consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
    )  # fmt: skip
    yield della_numba._merge_kernel, label, della
    stock = partial(blend_numba.stock, base, agents, out, ts=[0.5])
    yield blend_numba._stock_kernel, label, stock
    sce = partial(sce_numba.merge, base, agents, out, weights=[1.0] * n)
    yield sce_numba._merge_kernel, label, sce
    pick = partial(arcee_numba.merge, base, agents[0], np.zeros(size, np.float32), 0.5, out)
    yield arcee_numba._merge_kernel, label, pick


def _lora(theta: str, out: str) -> None:
    """One LoRA product through `kernels.lora`, on a 4 x 4 weight of rank 2."""
    import numpy as np

    from ram_dist.kernels import lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    zeros = np.zeros(16 * INFO[theta].itemsize, np.uint8)
    lora.values(zeros, theta, *factors, np.float32(1), 0, out, np.empty(64, np.uint8))


def warm(cache_dir: str | None = None) -> int:
    """Compile or load every specialization, printing a line per kernel; the exit code."""
    found = dispatchers()
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
    names = {id(k): name for name, k in found.items()}
    failed = 0
    start = time.perf_counter()
    for kernel, label, call in calls():
        began = time.perf_counter()
        try:
            call()
        except Exception as exc:  # report every failure, then exit non-zero
            what = f"{names[id(kernel)]} [{label}]: {type(exc).__name__}: {exc}"
            print(f"FAILED {what}", file=sys.stderr)
            failed += 1
        seconds[names[id(kernel)]] += time.perf_counter() - began
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
