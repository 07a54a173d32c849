"""What the kernel tests share: RL-like sparse inputs, TIES's and DELLA's parameters, and the
engine's reduce rounds and map pass run chunk by chunk through a method object, kernels on
or off (`tests/kernels/`; `test_kernel_cache.py` runs them in a subprocess to warm numba)."""

from __future__ import annotations

import json

import torch

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals


def sparse_inputs(n: int, dtypes: tuple[torch.dtype, ...], seed: int):
    """A base (dtypes[0]) and tasks (dtypes[1:]) with 3 %, 46 %, 54 %, ... changed."""
    g = torch.Generator().manual_seed(seed)
    base32 = torch.randn(n, generator=g) * 0.02
    base = base32.to(dtypes[0])
    tasks = []
    for t, dtype in enumerate(dtypes[1:]):
        mask = torch.rand(n, generator=g) < (0.03, 0.46, 0.54, 0.3)[t % 4]
        step = (1e-3 + base32.abs() * 2**-6) * torch.randn(n, generator=g)
        tasks.append((base.float() + torch.where(mask, step, 0.0)).to(dtype))
    return base, tasks


def stored(xs):
    """CPU tensors as the engine hands them to the fused methods: numpy arrays of the stored
    elements (bfloat16 as its uint16 bits)."""
    return [x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy() for x in xs]


def run(method_name, params, base, tasks, bounds, fused, out_dtype, as_stored=False, shape=None):
    """Reduce rounds then map, chunk by chunk, as the engine does; kernels on or off
    (`as_stored`: the fused calls take numpy arrays, as the engine's, not tensors; `shape`:
    the tensor's, flat by default)."""
    hand = stored if as_stored else list
    method = get_method(method_name)
    numel = base.numel()
    state = method.initial_state({"w": params}, {"w": numel}, len(tasks))
    pairs = zip(bounds, bounds[1:], strict=False)
    chunks = [(lo, base[lo:hi], [t[lo:hi] for t in tasks]) for lo, hi in pairs]
    totals_by_round = []
    for round_ in range(method.rounds):
        if not method.active(round_, state, "w"):
            continue
        totals: dict[str, torch.Tensor] = {}
        for lo, b, ts in chunks:
            chunk = Chunk("w", lo, shape or (numel,))
            got = method.fused_statistics(ChunkWork(chunk, params, state, round_), hand([b, *ts]))
            if fused and got is not None:
                stats = {k: torch.from_numpy(v) for k, v in got[0].items()}
            else:
                stats = method.chunk_statistics(ChunkWork(chunk, params, state, round_), b, ts)
            for key, value in stats.items():
                assert value.dtype == torch.int64
                totals[key] = totals[key] + value if key in totals else value
        totals_by_round.append(totals)
        state = method.finalize(RoundTotals(round_, totals, {"w": params}, {"w": numel}, state))
        state = json.loads(json.dumps(state))
    parts = []
    for lo, b, ts in chunks:
        chunk = Chunk("w", lo, shape or (numel,))
        if fused:
            out = torch.empty(b.numel(), dtype=out_dtype)
            assert method.fused_merge(ChunkWork(chunk, params, state), hand([b, *ts]), out)
            parts.append(out)
        else:
            parts.append(method.merge_chunk(ChunkWork(chunk, params, state), b, ts).to(out_dtype))
    return torch.cat(parts), state, totals_by_round


def ties_params(n_tasks: int, **kw):
    params = {
        "weight": [0.7, -0.35, 1.25, 0.4][:n_tasks],
        "density": [0.5, 0.3, 0.7, 1.0][:n_tasks],
        "normalize": True, "lambda": 1.0, "rescale": False,
    }  # fmt: skip
    return params | kw


def run_rows(
    method_name, params, base, tasks, shape, rows, fused, out_dtype, bounds=None, as_stored=False
):
    """The engine's round and map pass over chunks of whole rows (or of any `bounds`, flat
    indices, where no task is sampled); kernels on or off (`as_stored`: as `run`'s)."""
    hand = stored if as_stored else list
    method = get_method(method_name)
    numel, row = base.numel(), Chunk("w", 0, shape).row
    bounds = bounds or [r * row for r in rows]
    chunks = [
        (Chunk("w", lo, shape), base[lo:hi], [t[lo:hi] for t in tasks])
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    state = method.initial_state({"w": params}, {"w": numel}, len(tasks))
    totals: dict[str, torch.Tensor] = {}
    if method.active(0, state, "w"):
        for chunk, b, ts in chunks:
            if fused:
                got = method.fused_statistics(ChunkWork(chunk, params, state, 0), hand([b, *ts]))
                stats = {k: torch.from_numpy(v) for k, v in got[0].items()}
            else:
                stats = method.chunk_statistics(ChunkWork(chunk, params, state, 0), b, ts)
            for key, value in stats.items():
                totals[key] = totals[key] + value if key in totals else value
        state = method.finalize(RoundTotals(0, totals, {"w": params}, {"w": numel}, state))
        state = json.loads(json.dumps(state))
    parts = []
    for chunk, b, ts in chunks:
        if fused:
            out = torch.empty(b.numel(), dtype=out_dtype)
            assert method.fused_merge(ChunkWork(chunk, params, state), hand([b, *ts]), out)
            parts.append(out)
        else:
            parts.append(method.merge_chunk(ChunkWork(chunk, params, state), b, ts).to(out_dtype))
    return torch.cat(parts), state, totals


def della_params(n_tasks: int, **kw) -> dict:
    params = {
        "weight": [0.7, -0.35, 1.25][:n_tasks], "density": [0.5, 0.3, 1.0][:n_tasks],
        "epsilon": [0.2, 0.1, 0.15][:n_tasks], "normalize": True, "lambda": 1.0,
        "rescale": True, "seed": 9,
    }  # fmt: skip
    params.update(kw)
    return params
