"""Checkpoints of many small tensors (MoE norms, routers, scales): what a unit holds."""

from __future__ import annotations

import pytest

from ram_dist.planning.units import TensorSlot, plan_units


@pytest.mark.parametrize("max_pieces", [1, 3, 1000])
def test_units_hold_at_most_max_pieces(max_pieces):
    slots = [TensorSlot(f"t{i}", f"s{i // 700}", numel=1 + i % 5, row=1, max_itemsize=2)
             for i in range(2000)]  # fmt: skip
    units = plan_units(slots, 10**9, max_pieces)
    assert all(0 < len(u.pieces) <= max_pieces for u in units)
    assert [p.tensor for u in units for p in u.pieces] == [s.name for s in slots]
    per_shard = [700, 700, 600]
    assert len(units) == sum(-(-n // max_pieces) for n in per_shard)
    assert [u.index for u in units] == list(range(len(units)))


@pytest.mark.usefixtures("ray_local")
def test_a_shared_value_is_deserialized_once_per_worker_process():
    """`pool.Shared`: what every task takes (the layout, the parameters) crosses to each
    worker process once, whatever the number of tasks and maps."""
    import os

    from ram_dist.engine.pool import Shared, unordered_map

    shared = Shared({f"t{i}": {"epsilon": 1e-5, "r": 0.1} for i in range(1000)})

    def where(item: int, value: dict) -> tuple[int, int, int]:
        value["tasks"] = value.get("tasks", 0) + 1  # seen by the next task of this process
        return os.getpid(), value["tasks"], len(value)

    tasks: dict[int, int] = {}
    for _ in range(2):
        for _, _, (pid, count, size) in unordered_map(where, range(8), (shared,), 2, {}):
            assert size == 1001
            tasks[pid] = max(tasks.get(pid, 0), count)
    assert sum(tasks.values()) == 16  # each process counted every task it ran


def test_shard_header_is_the_json_of_the_header():
    """`writer.shard_header` writes the JSON of its entries itself: the same bytes as
    `json.dumps` of the header dict, names that need escaping and scalar shapes included."""
    import json
    import math

    from ram_dist.dtypes import itemsize
    from ram_dist.io.writer import OutTensor, shard_header

    def reference(tensors: list[OutTensor]) -> bytes:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            end = offset + math.prod(t.shape) * itemsize(t.dtype)
            header[t.name] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        return len(body).to_bytes(8, "little") + body

    tensors = [
        OutTensor("model.layers.0.mlp.experts.7.up_proj.weight_scale_inv", "F32", (1,)),
        OutTensor('odd "name" \\ \u00e9\u2028\n', "BF16", ()),
        OutTensor("empty", "F16", (0, 4)),
        OutTensor("w", "F8_E4M3", (3, 5, 7)),
    ] + [OutTensor(f"t{i}", "BF16", (i % 3 + 1, 2)) for i in range(100)]
    for case in (tensors, tensors[1:2], tensors[4:], []):
        assert shard_header(case) == reference(case)
