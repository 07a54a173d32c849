"""model_stock's, sce's, arcee_fusion's, the consensus methods', linear's, nearswap's,
DARE's and passthrough's fused map passes (and arcee_fusion's fused KL round and DARE's L1
round) against their eager torch rule on one tensor, without I/O.

One tensor of `--rows` x `--cols` (default 4096 x 4096, bf16): a synthetic base and RL-like
agents (task-vector densities about 3 %, 46 %, 54 %, ...; `ram_dist.synthetic`), `--tasks`
of them for model_stock, sce, the consensus methods and DARE, three for linear, the first
one for arcee_fusion, nearswap and passthrough (they merge one model); each method's
parameters at their
defaults but those a case sets. The method's reduce rounds run first, on the whole tensor
as one chunk; then the map pass is timed as the engine runs it on the CPU:
`merge_chunk(...).to(out_dtype)` (eager) against `fused_merge` writing the output dtype
(fused), alternating, `--repeats` times, on one thread, and the two outputs are checked for
byte equality. arcee_fusion's first round (its importances, with each row's KL, and their
histogram) and DARE's (the L1 sums of each task vector and of its kept part, for the
rescale) are timed the same way, with the two statistics checked for equality.

    python -m benchmarks.bench_method_maps --rows 4096 --cols 4096 --tasks 3 --repeats 3

from the repository root.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (label, method, parameters, how many of the agents it merges: None for all).
CASES: tuple[tuple[str, str, dict[str, Any], int | None], ...] = (
    ("model_stock", "model_stock", {"filter_wise": False}, None),
    ("model_stock filter_wise", "model_stock", {"filter_wise": True}, None),
    ("sce", "sce", {"select_topk": 1.0, "int8_mask": False}, None),
    ("sce select_topk 0.3", "sce", {"select_topk": 0.3, "int8_mask": False}, None),
    ("arcee_fusion", "arcee_fusion", {}, 1),
    ("consensus_ta k 2", "consensus_ta", {"k": 2}, None),
    ("consensus_ties density 0.5 k 2", "consensus_ties", {"density": 0.5, "k": 2}, None),
    ("linear", "linear", {"weight": [1.0, 0.5, 0.25], "normalize": True}, 3),
    ("nearswap t 0.01", "nearswap", {"t": 0.01}, 1),
    ("dare_linear density 0.5", "dare_linear", {"density": 0.5}, None),
    ("dare_ties density 0.5", "dare_ties", {"density": 0.5}, None),
    ("passthrough", "passthrough", {}, 1),
)


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


def prepared(method: Any, params: dict, chunk: Chunk, base: torch.Tensor, tasks: list) -> dict:
    """The state after the method's reduce rounds on one chunk (the eager statistics)."""
    numel = base.numel()
    state = method.initial_state({"w": params}, {"w": numel}, len(tasks))
    for round_ in range(method.rounds):
        if method.active(round_, state, "w"):
            totals = method.chunk_statistics(ChunkWork(chunk, params, state, round_), base, tasks)
            state = method.finalize(RoundTotals(round_, totals, {"w": params}, {"w": numel}, state))
    return state


def passes(
    label: str, method: Any, params: dict, state: dict, chunk: Chunk, data: tuple, held: dict
) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(what, eager, fused) of each pass timed for one case; each call keeps its result in
    `held` (`e`, `f`; a round's `es`, `fs`). `data`: the base and tasks as tensors, the
    inputs as the engine hands them, the output array."""
    base, ts, inputs, out = data
    dtype = base.dtype

    def eager_map() -> None:
        held["e"] = method.merge_chunk(ChunkWork(chunk, params, state), base, ts).to(dtype)

    def fused_map() -> None:
        held["f"] = method.fused_merge(ChunkWork(chunk, params, state), inputs, out)

    def eager_round() -> None:
        held["es"] = method.chunk_statistics(ChunkWork(chunk, params, state, 0), base, ts)

    def fused_round() -> None:
        held["fs"] = method.fused_statistics(ChunkWork(chunk, params, state, 0), inputs)

    found = [(f"{label}: map", eager_map, fused_map)]
    if method.name == "arcee_fusion":
        found.append((f"{label}: round 1 (KL, histogram)", eager_round, fused_round))
    if method.name in ("dare_linear", "dare_ties"):
        found.append((f"{label}: round 1 (L1 sums)", eager_round, fused_round))
    return found


def bench(
    shape: tuple[int, int], tasks: int, dtype: torch.dtype, repeats: int, cases: list
) -> None:
    n = shape[0] * shape[1]
    base = base_tensor("w", (n,), 0, dtype)
    densities = AGENT_DENSITIES + (0.2, 0.1, 0.3)
    agents = [task_tensor(base, "w", densities[t % 6], 1 + t) for t in range(tasks)]
    chunk = Chunk("w", 0, shape)
    print(f"{shape[0]} x {shape[1]} = {n} elements, {dtype} in and out, 1 thread, "
          f"median of {repeats} (alternating)")  # fmt: skip
    print(f"{'pass':<34}{'eager s':>9}{'fused s':>9}{'eager Mel/s':>13}{'fused Mel/s':>13}"
          f"{'speedup':>9}  identical")  # fmt: skip
    for label, name, params, count in cases:
        method = get_method(name)
        ts = agents[:count] if count else agents
        params = full_params(method, params, len(ts))
        state = prepared(method, params, chunk, base, ts)
        inputs = [raw(base), *map(raw, ts)]
        out = np.empty(n, raw(base).dtype)
        held: dict[str, Any] = {}
        rows = passes(label, method, params, state, chunk, (base, ts, inputs, out), held)
        for what, eager, fused in rows:
            fused()  # compile (or load from the cache) outside the timings
            samples: dict[str, list[float]] = {"e": [], "f": []}
            for _ in range(repeats):
                samples["e"].append(timed(eager))
                samples["f"].append(timed(fused))
            if "es" in held:
                same = np.array_equal(held.pop("es")["w"].numpy(), held.pop("fs")[0]["w"])
            else:
                same = bool(held.pop("f")) and np.array_equal(
                    held.pop("e").contiguous().view(torch.uint8).numpy(), out.view(np.uint8)
                )
            e, f = (statistics.median(samples[k]) for k in ("e", "f"))
            print(f"{what:<34}{e:>9.3f}{f:>9.3f}{n / e / 1e6:>13.1f}{n / f / 1e6:>13.1f}"
                  f"{e / f:>8.1f}x  {same}")  # fmt: skip
            for key, values in samples.items():
                print(f"  samples {key}: " + " ".join(f"{v:.3f}" for v in values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--method", action="append", choices=sorted({c[1] for c in CASES}),
        help="time only this method's cases; repeat for more (default: all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one Ray worker per core: compare single-threaded
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    cases = [c for c in CASES if not args.method or c[1] in args.method]
    bench((args.rows, args.cols), args.tasks, DTYPES[args.dtype], args.repeats, cases)


if __name__ == "__main__":
    main()
