"""Every method's fused passes against its eager torch rule on one tensor, without I/O, each
beside a one-thread copy of the bytes it reads (the CPU's memcpy ceiling).

One tensor of `--rows` x `--cols` (default 4096 x 4096, bf16): a synthetic base and RL-like
agents (task-vector densities about 3 %, 46 %, 54 %; `ram_dist.synthetic`). Every method of
the registry has one case: the agents and parameters `bench_methods` merges it with
(`benchmarks.method_table`; a method without a base still gets the base as its first input,
which it does not read), the method's defaults for the rest. A few variants follow
(`VARIANTS`). Each of the method's reduce rounds runs on the whole tensor as one chunk, the
fused kernel timed against `chunk_statistics` from the state before that round, and then
the map pass: `merge_chunk(...).to(out_dtype)` (eager) against `fused_merge` writing the
output dtype (fused). Eager, fused and a plain copy of the inputs' bytes (the base and the
agents: one `numpy.copyto`, one thread, so it reads and writes that many bytes) alternate,
`--repeats` times; medians are printed. `of memcpy` is the fused pass's rate over the copy's,
in the same elements. Each round's two statistics and each map's two outputs are checked
for equality (`identical`).

    python -m benchmarks.bench_method_maps --rows 4096 --cols 4096 --repeats 3
    python -m benchmarks.bench_method_maps --method della --method model_stock --fused-only

from the repository root.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks import method_table
from ram_dist.methods import METHODS, get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Cases beyond each method's own: (label, method, parameters over the method's case's).
VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("model_stock filter_wise", "model_stock", {"filter_wise": True}),
    ("sce select_topk 1.0", "sce", {"select_topk": 1.0}),
    ("consensus_ta k 2", "consensus_ta", {"k": 2}),
    ("consensus_ties k 2", "consensus_ties", {"k": 2}),
    ("linear weights 1, 0.5, 0.25", "linear", {"weight": [1.0, 0.5, 0.25]}),
)


@dataclass(frozen=True)
class Case:
    """One method at one set of parameters, on its first `agents` agents."""

    label: str
    method: str
    given: dict[str, Any]
    agents: int


def cases(methods: list[str] | None = None) -> list[Case]:
    """Every registry method's case (`method_table`'s merge), then the variants; only
    `methods`' when given."""
    found = []
    for name in METHODS:
        spec = method_table.METHODS[name]
        each = spec.each if isinstance(spec.each, list) else [spec.each] * spec.agents
        given = dict(spec.top) | {k: [e[k] for e in each] for k in {k for e in each for k in e}}
        found.append(Case(name, name, given, spec.agents))
    own = {c.method: c for c in found}
    for label, name, given in VARIANTS:
        found.append(Case(label, name, own[name].given | given, own[name].agents))
    return [c for c in found if not methods or c.method in methods]


def full_params(method: Any, given: dict[str, Any], n_tasks: int) -> dict[str, Any]:
    """The method's parameters at their defaults (`flag_table.default_params`), `given` over
    them (a per-task value given once stands for every task)."""
    from ram_dist.cli.flag_table import default_params

    per_task = {p.name for p in method.parameters if p.per_task}
    given = {k: [v] * n_tasks if k in per_task and not isinstance(v, list) else v
             for k, v in given.items()}  # fmt: skip
    return default_params(method, n_tasks) | given


def raw(x: torch.Tensor) -> np.ndarray:
    """A tensor as the engine hands it to the fused methods (bfloat16 as its uint16 bits)."""
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def same(a: Any, b: Any) -> bool:
    """Whether two statistics are equal, whatever their nesting (torch or numpy arrays,
    mappings, sequences, numbers; NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        a = a.numpy()
    if isinstance(b, torch.Tensor):
        b = b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        nan = a.dtype.kind in "fc" and b.dtype.kind in "fc"
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=nan))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b or (a != a and b != b))


@dataclass
class Pass:
    """One timed pass: its label, its eager and fused calls, and how their results compare."""

    what: str
    eager: Callable[[], Any]
    fused: Callable[[], Any]
    identical: Callable[[Any, Any], bool]


def passes(method: Any, params: dict, chunk: Chunk, data: tuple) -> list[Pass]:
    """Each reduce round the method runs (from the state before it), then the map pass.
    `data`: the base and tasks as tensors, the inputs as the engine hands them, the output
    array. The eager statistics of each round give the state of the next."""
    base, ts, inputs, out = data
    found = []
    state = method.initial_state({"w": params}, {"w": base.numel()}, len(ts))
    for r in range(method.rounds):
        if not method.active(r, state, "w"):
            continue
        work = ChunkWork(chunk, params, copy.deepcopy(state), r)  # `finalize` may change it
        found.append(
            Pass(
                f"round {r + 1}",
                lambda work=work: method.chunk_statistics(work, base, ts),
                lambda work=work: method.fused_statistics(work, inputs),
                lambda e, f: f is not None and same(e, f[0]),
            )
        )
        totals = method.chunk_statistics(work, base, ts)
        state = method.finalize(RoundTotals(r, totals, {"w": params}, {"w": base.numel()}, state))
    work = ChunkWork(chunk, params, state)

    def fused_map() -> bool:
        return method.fused_merge(work, inputs, out)

    def identical(e: torch.Tensor, f: bool) -> bool:
        return f and np.array_equal(e.contiguous().view(torch.uint8).numpy(), out.view(np.uint8))

    found.append(
        Pass("map", lambda: method.merge_chunk(work, base, ts).to(base.dtype), fused_map, identical)
    )
    return found


@dataclass(frozen=True)
class Row:
    """One pass's medians (eager None when not timed) and whether both ways agreed."""

    case: str
    what: str
    eager_s: float | None
    fused_s: float
    memcpy_s: float
    identical: bool


def bench(shape: tuple[int, int], dtype: torch.dtype, repeats: int, todo: list[Case],
          eager: bool) -> list[Row]:  # fmt: skip
    """Every pass of every case in `todo`, printed as it is measured, and returned."""
    n = shape[0] * shape[1]
    base = base_tensor("w", (n,), 0, dtype)
    agents = [task_tensor(base, "w", d, 1 + t) for t, d in enumerate(AGENT_DENSITIES)]
    chunk = Chunk("w", 0, shape)
    print(f"{shape[0]} x {shape[1]} = {n} elements, {dtype} in and out, 1 thread, "
          f"median of {repeats} (alternating)")  # fmt: skip
    print(f"{'case: pass':<44}{'eager s':>9}{'fused s':>9}{'eager Mel/s':>13}{'fused Mel/s':>13}"
          f"{'speedup':>9}{'memcpy s':>10}{'of memcpy':>11}  identical")  # fmt: skip
    rows = []
    for case in todo:
        method = get_method(case.method)
        ts = agents[: case.agents]
        params = full_params(method, case.given, len(ts))
        inputs = [raw(base), *map(raw, ts)]
        out = np.empty(n, raw(base).dtype)
        src = np.concatenate([a.view(np.uint8) for a in inputs])
        dst = np.zeros_like(src)  # pages touched

        def memcpy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            np.copyto(dst, src)

        for p in passes(method, params, chunk, (base, ts, inputs, out)):
            p.fused()  # compile (or load from the cache) outside the timings
            samples: dict[str, list[float]] = {"e": [], "f": [], "c": []}
            results: dict[str, Any] = {}
            for _ in range(repeats):
                samples["c"].append(timed(memcpy))
                if eager:
                    samples["e"].append(timed(lambda p=p, r=results: r.update(e=p.eager())))
                samples["f"].append(timed(lambda p=p, r=results: r.update(f=p.fused())))
            if not eager:
                results["e"] = p.eager()
            med = {k: statistics.median(v) for k, v in samples.items() if v}
            row = Row(case.label, p.what, med.get("e"), med["f"], med["c"],
                      p.identical(results["e"], results["f"]))  # fmt: skip
            print(format_row(row, n))
            for key, values in samples.items():
                if values:
                    print(f"  samples {key}: " + " ".join(f"{v:.3f}" for v in values))
            rows.append(row)
    return rows


def format_row(row: Row, n: int) -> str:
    e, f, c = row.eager_s, row.fused_s, row.memcpy_s
    cells = (f"{e:>9.3f}", f"{n / e / 1e6:>13.1f}", f"{e / f:>8.1f}x") if e else (
        f"{'-':>9}", f"{'-':>13}", f"{'-':>9}")  # fmt: skip
    return (f"{row.case + ': ' + row.what:<44}{cells[0]}{f:>9.3f}{cells[1]}{n / f / 1e6:>13.1f}"
            f"{cells[2]}{c:>10.3f}{c / f:>10.2f}x  {row.identical}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--method", action="append", choices=sorted(METHODS),
        help="time only this method's cases; repeat for more (default: every method)",
    )  # fmt: skip
    parser.add_argument(
        "--fused-only", action="store_true",
        help="time the fused passes and the copy only; the eager rule runs once, to compare",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one Ray worker per core: compare single-threaded
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    todo = cases(args.method)
    bench((args.rows, args.cols), DTYPES[args.dtype], args.repeats, todo, not args.fused_only)


if __name__ == "__main__":
    main()
