"""della's fused kernels and breadcrumbs' fused map pass on one chunk of whole rows, without
I/O: della's L1 round and map pass against the same kernels at git revision `--before`
(copied aside, compiled here, not cached: at e8bdae0, their ranks by a byte radix sort of
every row), checking both give the same statistics and bytes; breadcrumbs' map pass on
TIES's merge kernel against its eager rule (`Breadcrumbs.merge_chunk` and the cast), checking
the bytes. The inputs are a synthetic bf16 base and RL-like agents (`bench_kernels`'), in
`--elements // --row` rows. The runs alternate, `--repeats` times; medians of CPU time
(`time.process_time`, one thread) are printed, in seconds and nanoseconds per element.

    python -m benchmarks.bench_sparse --elements 16M --row 4096 --before e8bdae0 --repeats 5

from the repository root.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_kernels import REPO_ROOT, make_inputs, parse_count
from ram_dist.methods.protocol import ChunkWork, RoundTotals


def kernels_at(revision: str) -> Any:
    """`kernels.della_numba` as it was at a git revision, imported from a temp copy, its
    kernels compiled here (not cached)."""
    import importlib.util

    source = subprocess.run(
        ["git", "show", f"{revision}:ram_dist/kernels/della_numba.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.replace("@njit(cache=True", "@njit(cache=False")  # fmt: skip
    path = Path(tempfile.mkdtemp()) / f"della_numba_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_time(fn: Callable[[], object]) -> float:
    began = time.process_time()
    fn()
    return time.process_time() - began


def bench(n: int, row: int, tasks: int, before: str | None, repeats: int) -> None:
    """della's kernels (against `before`'s) and breadcrumbs' map pass (against its eager
    rule) on `n // row` rows of bfloat16 inputs."""
    from ram_dist.kernels import della_numba
    from ram_dist.methods import get_method
    from ram_dist.methods.protocol import Chunk

    n -= n % row
    base, agents = make_inputs(n, tasks, torch.bfloat16, seed=0)
    della = dict(start=0, groups=(row, 1), stream_keys=[11 + t for t in range(tasks)],
                 densities=[0.5] * tasks, epsilons=[0.1] * tasks)  # fmt: skip
    combine = dict(factors=[1.25] * tasks, weights=[1.0 / tasks] * tasks, consensus=True,
                   normalize=True, divisor=1.0, lambda_=1.0)  # fmt: skip
    modules = {"this": della_numba} | ({before: kernels_at(before)} if before else {})
    outs = {name: torch.empty(n, dtype=torch.bfloat16) for name in modules}
    stats = {}
    for name, m in modules.items():  # compile (or load) outside the timings
        stats[name] = m.statistics(base, agents, **della)
        m.merge(base, agents, outs[name], **della, **combine)
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, m in modules.items():
            reduce = cpu_time(lambda m=m: m.statistics(base, agents, **della))
            merge = cpu_time(lambda m=m, name=name: m.merge(base, agents, outs[name], **della,
                                                            **combine))  # fmt: skip
            samples.setdefault(f"della reduce, {name}", []).append(reduce)
            samples.setdefault(f"della map, {name}", []).append(merge)
    same = all(np.array_equal(stats["this"], s) for s in stats.values()) and all(
        torch.equal(outs["this"].view(torch.int16), o.view(torch.int16)) for o in outs.values()
    )
    # breadcrumbs: its rounds (fused), then the map pass fused and eager
    method = get_method("breadcrumbs")
    params = {"weight": [1.0 / tasks] * tasks, "density": [0.5] * tasks,
              "gamma": [0.01] * tasks, "normalize": False, "lambda": 1.0,
              "rescale": False}  # fmt: skip
    chunk, inputs = Chunk("w", 0, (n // row, row)), [base, *agents]
    state = method.initial_state({"w": params}, {"w": n}, tasks)
    for round_ in range(method.rounds):
        if method.active(round_, state, "w"):
            got = method.fused_statistics(ChunkWork(chunk, params, state, round_), inputs)
            totals = {k: torch.from_numpy(v) for k, v in got[0].items()}
            state = method.finalize(RoundTotals(round_, totals, {"w": params}, {"w": n}, state))
    fused_out = torch.empty(n, dtype=torch.bfloat16)
    holder = {}

    def eager() -> None:
        holder["eager"] = method.merge_chunk(ChunkWork(chunk, params, state), base, agents).to(
            torch.bfloat16
        )

    def fused() -> None:
        method.fused_merge(ChunkWork(chunk, params, state), inputs, fused_out)

    fused()
    for _ in range(repeats):
        samples.setdefault("breadcrumbs map, eager", []).append(cpu_time(eager))
        samples.setdefault("breadcrumbs map, fused", []).append(cpu_time(fused))
    same_bc = torch.equal(holder["eager"].view(torch.int16), fused_out.view(torch.int16))
    print(f"{n} elements ({n // row} rows of {row}), base + {tasks} tasks, bf16, CPU time, "
          f"median of {repeats} (alternating)")  # fmt: skip
    print(f"{'pass':<34}{'s':>9}{'ns/element':>12}")
    for key, values in samples.items():
        med = statistics.median(values)
        print(f"{key:<34}{med:>9.4f}{med / n * 1e9:>12.2f}")
    print(f"della: same statistics and bytes as {before}: {same}; "
          f"breadcrumbs: fused bytes are the eager rule's: {same_bc}")  # fmt: skip
    for key, values in samples.items():
        print(f"  samples {key}: " + " ".join(f"{v:.4f}" for v in values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", default="16M", help="chunk length, e.g. 16M (default)")
    parser.add_argument("--row", default="4096", help="elements per row (default 4096)")
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--before", help="time della's kernels at this git revision too")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one Ray worker per core: compare single-threaded
    rows = parse_count(args.row)
    bench(parse_count(args.elements), rows, args.tasks, args.before, args.repeats)


if __name__ == "__main__":
    main()
