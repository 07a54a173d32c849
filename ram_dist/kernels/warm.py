"""Build numba's disk cache for the fused kernels, so that jobs load them instead of compiling.

    python -m ram_dist.kernels.warm [--tasks 8] [--dtype bf16 ...] [--out-dtype bf16 ...]
                                    [--cache-dir DIR]

Every `@njit(cache=True)` kernel compiles one specialization per argument types: per number
of tasks, per dtype of each input and per output dtype, about a second each, in every
worker process that finds it in no cache (loading one takes about 10 ms). This calls every
kernel through its public wrapper, on tiny inputs, so that the signatures are exactly those
a job meets: base and tasks of one dtype (bfloat16, float16, float32, and fine-grained FP8,
which every method's kernels read as stored and RAM's can write again, with FP8 or bfloat16
tasks; an MXFP4 or packed INT base with bfloat16 values, `quantized`, which they read as
stored too, with bfloat16 tasks; other mixed dtypes are not warmed), 1 to `--tasks` tasks,
and every output dtype a merge kernel writes (those three and float64), the LoRA product in
each dtype, the exact sums of products, the first reduce round's precision check, and
MXFP4's and packed INT4/INT8's decoding (the eager path's); arcee_fusion's kernels for one
task only (it merges one model). All of it is 1379 specializations (586 of them, all but
the decoding, the quantized and FP8 bases' other kernels and model_stock's, sce's and
arcee_fusion's kernels, took 1,464 s on one core of the development machine).

The cache goes where numba puts it: `--cache-dir` (or `NUMBA_CACHE_DIR`), else `__pycache__`
beside the kernel modules when that is writable, else numba's user-wide cache directory
(`~/.cache/numba`), else a directory in the temp dir (`ram_dist.kernels.use_writable_cache`).
Entries are keyed on the kernel source and on the CPU (model name and features): on another
CPU a job compiles again. Prints, per kernel, what was compiled and what loaded; exits 1 if
a call failed, 2 if numba would not cache into `--cache-dir`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np

from ram_dist.dtypes import INFO
from ram_dist.kernels import READS, WRITES

#: The --dtype name of fine-grained FP8 inputs (e4m3 bytes and block scales), which the
#: kernels read as stored (`MergeMethod.reads_stored`).
FP8 = "fp8"
#: The --dtype name of MXFP4 and packed INT4/INT8 inputs whose values are bfloat16 (every
#: MXFP4 weight, an INT weight with bfloat16 scales), which the kernels read as stored.
QUANTIZED = "quantized"
#: --dtype names -> torch dtype names (the inputs' dtype): every dtype the kernels read.
DTYPES = {**{INFO[d].short: INFO[d].torch for d in READS}, FP8: FP8, QUANTIZED: QUANTIZED}
#: --out-dtype names: every output dtype the merge kernels write.
OUT_DTYPES = {INFO[d].short: INFO[d].torch for d in WRITES}
#: Task counts 1..TASKS by default (the methods take any number).
TASKS = 8
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


def calls(
    dtypes: list[str], tasks: int, out_dtypes: list[str]
) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """(dispatcher, label, call) for every specialization to warm."""
    import torch

    from ram_dist.kernels import lora_numba, precision_numba, ram_numba, scan_numba

    for name in dtypes:
        if name == FP8:
            yield from _fp8_calls(tasks, out_dtypes)
            continue
        if name == QUANTIZED:
            yield from _quantized_calls(tasks, out_dtypes)
            continue
        for n in range(1, tasks + 1):
            base = torch.zeros(N, dtype=getattr(torch, name))
            agents = [torch.zeros_like(base) for _ in range(n)]
            label = f"{name} x {n}"
            counts = partial(ram_numba.overlap_counts_nonfinite, base, agents, EPS)
            yield ram_numba._count_kernel, label, counts
            if name == "float32":  # a float32 base's precision check (16-bit bases have none)
                check = partial(precision_numba.check_counts, [base, *agents], EPS)
                yield precision_numba._check_kernel, label, check
            for out_name in out_dtypes:
                out = torch.empty(N, dtype=getattr(torch, out_name))
                ram = partial(ram_numba.merge_ram, base, agents, EPS, [1.0] * n, out)
                yield ram_numba._merge_kernel, f"{label} -> {out_name}", ram
            yield from _method_calls(base, agents, label, out_dtypes)
    # The finiteness scan reads raw bits: one specialization per width (float64 included).
    for name in ("bfloat16", "float32", "float64"):
        x = torch.zeros(N, dtype=getattr(torch, name))
        yield scan_numba._count, name, partial(scan_numba.nonfinite_count, x)
    # A LoRA task's values: in the base's dtype, and bfloat16 over an FP8 base's float32.
    code = {INFO[d].torch: d for d in READS}
    pairs = [(code[d], code[d]) for d in dtypes if d in code] + [("F32", "BF16")]
    pairs += [("BF16", "BF16")] if QUANTIZED in dtypes else []  # over a quantized base
    for theta, out in dict.fromkeys(pairs):
        yield lora_numba.lora_values, f"LoRA {theta} -> {out}", partial(_lora, theta, out)
    # Exact sums of products (the geometric methods' norms and dot products): float32 only.
    from ram_dist.kernels import exact_sums, exact_sums_numba

    vectors = np.zeros((2, N), np.float32)
    pairs = exact_sums.pairs_of(2)
    yield exact_sums_numba.gram, "exact sums", partial(exact_sums.gram, vectors, pairs)
    rows = partial(exact_sums.row_gram, vectors, pairs, N // 2)
    yield exact_sums_numba.row_gram, "exact sums per row", rows
    # arcee_fusion's histograms of its importances (one signature: float32 in)
    from ram_dist.kernels import arcee_numba

    counts = partial(arcee_numba.histogram, np.zeros(N, np.float32), [0])
    yield arcee_numba._histogram_kernel, "arcee_fusion histograms", counts
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
    base: Any, agents: list[Any], label: str, out_dtypes: list[str]
) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """The kernels of the methods other than RAM on one base and its agents (any form the
    kernels read: arrays, or a quantized base as stored): TIES's and DELLA's statistics,
    arcee_fusion's importances (one model), and their merges, the geometric methods' blend,
    model_stock's and sce's merges into each output dtype."""
    import torch

    from ram_dist.kernels import arcee_numba, blend_numba, della_numba, sce_numba, ties_numba

    n, size = len(agents), int(base.numel() if isinstance(base, torch.Tensor) else base.size)
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
    if n == 1:  # arcee_fusion's importances (one model; rows of 4)
        imp = partial(arcee_numba.importance, base, agents[0], 4)
        yield arcee_numba._importance_kernel, label, imp
    for out_name in out_dtypes:
        out = torch.empty(size, dtype=getattr(torch, out_name))
        ties = partial(ties_numba.merge, base, agents, out, **ties_args)
        yield ties_numba._merge_kernel, f"{label} -> {out_name}", ties
        # the geometric methods' blend (its mode is a value: one signature)
        mix = partial(blend_numba.blend, base, agents, out, mode=blend_numba.MODELS,
                      factors=[1.0] * n)  # fmt: skip
        yield blend_numba._blend_kernel, f"{label} -> {out_name}", mix
        della = partial(
            della_numba.merge, base, agents, out, **della_args, factors=[None] * n,
            weights=[1.0] * n, consensus=True, normalize=True, divisor=1.0, lambda_=1.0,
        )  # fmt: skip
        yield della_numba._merge_kernel, f"{label} -> {out_name}", della
        stock = partial(blend_numba.stock, base, agents, out, ts=[0.5])
        yield blend_numba._stock_kernel, f"{label} -> {out_name}", stock
        sce = partial(sce_numba.merge, base, agents, out, weights=[1.0] * n)
        yield sce_numba._merge_kernel, f"{label} -> {out_name}", sce
        if n == 1:  # arcee_fusion's selection (one model)
            imp = np.zeros(size, np.float32)
            pick = partial(arcee_numba.merge, base, agents[0], imp, 0.5, out)
            yield arcee_numba._merge_kernel, f"{label} -> {out_name}", pick


def _fp8_calls(tasks: int, out_dtypes: list[str]) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """The kernels on an FP8 base (`fp8.Fp8Values`) with FP8 tasks and with bfloat16 ones
    (an RL trainer's agents): RAM's counts, its merge into each output dtype and its merge
    written as FP8 blocks; the first round's precision check; the other methods' kernels
    (`_method_calls`)."""
    import torch

    from ram_dist.kernels import fp8, precision_numba, ram_numba

    cols, block = 4, (2, 2)
    base = fp8.Fp8Values(np.zeros(N, np.uint8), np.ones(4, np.float32), cols, block)
    for n, agent in itertools.product(range(1, tasks + 1), (base, np.zeros(N, np.uint16))):
        agents = [agent] * n
        label = f"{FP8} x {n}" + (" bf16" if agent is not base else "")
        counts = partial(ram_numba.overlap_counts_nonfinite, base, agents, EPS)
        yield ram_numba._count_kernel, label, counts
        check = partial(precision_numba.check_counts, [base, *agents], EPS)
        yield precision_numba._check_kernel, label, check
        for out_name in out_dtypes:
            out = torch.empty(N, dtype=getattr(torch, out_name))
            ram = partial(ram_numba.merge_ram, base, agents, EPS, [1.0] * n, out)
            yield ram_numba._merge_kernel, f"{label} -> {out_name}", ram
        scales = np.ones(4, np.float32).view(np.uint8)
        target = fp8.Fp8Target(np.empty(N, np.uint8), "F32", scales, np.empty_like(scales))
        to_fp8 = partial(ram_numba.merge_ram_fp8, base, agents, EPS, [1.0] * n, target)
        yield ram_numba._merge_fp8_kernel, f"{label} -> {FP8}", to_fp8
        yield from _method_calls(base, agents, label, out_dtypes)


def _quantized_calls(
    tasks: int, out_dtypes: list[str]
) -> Iterator[tuple[Any, str, Callable[[], Any]]]:
    """The kernels on a quantized base read as stored (`quantized.QuantizedValues` with
    bfloat16 values: MXFP4, or packed INT with bfloat16 scales, one kernel type for both)
    with bfloat16 tasks: RAM's counts and merge into each output dtype, and the other
    methods' kernels (`_method_calls`). (Such a base and bfloat16 tasks need no precision
    check.)"""
    import torch

    from ram_dist.kernels import quantized, ram_numba

    base = quantized.mxfp4_values(np.zeros(16, np.uint8), np.full(1, 127, np.uint8), 1, 1)
    for n in range(1, tasks + 1):
        agents = [np.zeros(base.size, np.uint16)] * n
        label = f"{QUANTIZED} x {n} bf16"
        counts = partial(ram_numba.overlap_counts_nonfinite, base, agents, EPS)
        yield ram_numba._count_kernel, label, counts
        for out_name in out_dtypes:
            out = torch.empty(base.size, dtype=getattr(torch, out_name))
            ram = partial(ram_numba.merge_ram, base, agents, EPS, [1.0] * n, out)
            yield ram_numba._merge_kernel, f"{label} -> {out_name}", ram
        yield from _method_calls(base, agents, label, out_dtypes)


def _lora(theta: str, out: str) -> None:
    """One LoRA product through `kernels.lora`, on a 4 x 4 weight of rank 2."""
    import numpy as np

    from ram_dist.kernels import lora

    factors = np.zeros((4, 2), np.float32), np.zeros((2, 4), np.float32)
    zeros = np.zeros(16 * INFO[theta].itemsize, np.uint8)
    lora.values(zeros, theta, *factors, np.float32(1), 0, out, np.empty(64, np.uint8))


def warm(dtypes: list[str], tasks: int, out_dtypes: list[str], cache_dir: str | None = None) -> int:
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
    for kernel, label, call in calls(dtypes, tasks, out_dtypes):
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
    what = f"{', '.join(dtypes)}; 1..{tasks} tasks; out {', '.join(out_dtypes)}"
    elapsed = time.perf_counter() - start
    print(f"{total} specializations ({what}) in {elapsed:.1f} s; {failed} failed")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ram_dist.kernels.warm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--tasks", type=int, default=TASKS, help=f"warm 1 to TASKS tasks (default {TASKS})"
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=list(DTYPES),
        help="the inputs' dtype; repeat for more (default: all)",
    )
    parser.add_argument(
        "--out-dtype",
        action="append",
        choices=list(OUT_DTYPES),
        help="a merge's output dtype; repeat for more (default: all)",
    )
    parser.add_argument("--cache-dir", help="numba's cache directory (sets NUMBA_CACHE_DIR)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tasks < 1:
        parser.error("--tasks must be at least 1")
    if args.cache_dir is not None:
        os.environ["NUMBA_CACHE_DIR"] = args.cache_dir  # read when numba is first imported
    dtypes = [DTYPES[d] for d in args.dtype or DTYPES]
    out_dtypes = [OUT_DTYPES[d] for d in args.out_dtype or OUT_DTYPES]
    return warm(dtypes, args.tasks, out_dtypes, args.cache_dir)


if __name__ == "__main__":
    sys.exit(main())
