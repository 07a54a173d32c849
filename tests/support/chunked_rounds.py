"""A method's reduce rounds and map pass run as the engine runs them, on chunks of flat
indices, in this process (no Ray): what the method tests compare with whole-tensor
references to show a result does not depend on where the chunks are cut."""

from __future__ import annotations

import json

import torch

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork, RoundTotals


def run_chunked(
    method: str, base, tasks, bounds, params, name: str = "w"
) -> tuple[torch.Tensor, dict]:
    """The merged tensor and the driver's last state, on chunks [bounds[i], bounds[i+1]):
    each round's integer statistics summed over the chunks, the state passed through JSON
    as the driver passes it to the workers."""
    m = get_method(method)
    shape, numel = tuple(base.shape), base.numel()
    flat_b, flat_t = base.reshape(-1), [t.reshape(-1) for t in tasks]

    def pieces():
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            yield Chunk(name, lo, shape), flat_b[lo:hi], [t[lo:hi] for t in flat_t]

    state = m.initial_state({name: params}, {name: numel}, len(tasks))
    for round_ in range(m.rounds):
        if not m.active(round_, state, name):
            continue
        totals: dict[str, torch.Tensor] = {}
        for chunk, b, ts in pieces():
            for key, value in m.chunk_statistics(
                ChunkWork(chunk, params, state, round_), b, ts
            ).items():
                assert value.dtype == torch.int64, key
                totals[key] = totals[key] + value if key in totals else value
        state = m.finalize(RoundTotals(round_, totals, {name: params}, {name: numel}, state))
        state = json.loads(json.dumps(state))
    parts = [m.merge_chunk(ChunkWork(c, params, state), b, ts) for c, b, ts in pieces()]
    return torch.cat(parts).reshape(base.shape), state
