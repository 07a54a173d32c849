"""The worker functions run inline (no Ray): compute blocks and units change no byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import build_model_set
from reference import reference_merge, reference_stats

from ram_dist.engine import blocks, driver, map_step, reduce_step, unit_results, worker
from ram_dist.io.sinks import DriverTarget
from ram_dist.methods import get_method
from ram_dist.methods.protocol import RoundTotals
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.units import Part


def _map(unit, layout, storage, method, params, state) -> np.ndarray:
    """A unit's merged bytes as the map pass makes them (`map_part`): the one unit of a part,
    sent back through the driver. They live in the worker's reused output buffer."""
    part = Part(unit.shard, 1, (unit.index,), 0, map_step.unit_out_bytes(unit, layout))
    work = map_step.PartWork(part, (unit,), b"", DriverTarget("inline"))
    context = worker.TaskContext(layout, storage, method, params, state)
    return map_step.map_part(work, context).receipt.data


@pytest.mark.parametrize("block", [7, 1000, 1 << 22])
def test_units_and_compute_blocks_reassemble_the_reference(tmp_path, monkeypatch, block):
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", block)
    base_dir, task_dirs, base, tasks = build_model_set(
        tmp_path, kind="llama", task_dtypes=[torch.float32, None, torch.float16]
    )
    config = MergeConfig(
        base=str(base_dir), tasks=tuple(map(str, task_dirs)), unit_budget_bytes=3000
    )
    job = driver.prepare(config)
    method, state = get_method("ram_plus"), job.initial_state()
    args = (job.layout, job.storage, method, job.params)
    totals: dict[str, np.ndarray] = {}
    for unit in job.units:
        with worker.worker_context().work() as scope:
            result = reduce_step.reduce_unit(
                unit, worker.TaskContext(*args, state), 0, False, scope
            )
        reduce_step.add_up(result, totals, {})
    sums = {key: torch.from_numpy(value) for key, value in totals.items()}
    state = method.finalize(RoundTotals(0, sums, job.params, job.numel(), state))
    ref = reference_stats(base, tasks)
    histograms = [t["histogram"] for t in state["summary"]["tasks"]]
    assert histograms == [list(map(int, h)) for h in ref["H"]]

    blobs: dict[str, list[bytes]] = {}
    previous = None
    for unit in job.units:
        result = _map(unit, *args, state)
        if previous is not None:  # the worker's output buffer is used again
            assert np.shares_memory(result, previous)
        previous, data = result, result.tobytes()
        offset = 0
        for piece in unit.pieces:
            size = piece.numel * base[piece.tensor].element_size()
            blobs.setdefault(piece.tensor, []).append(data[offset : offset + size])
            offset += size
        assert offset == len(data)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    for name, want in expected.items():
        assert b"".join(blobs[name]) == want.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("small", "group"), [(0, 4096), (1 << 16, 4096), (1 << 16, 5), (20_000, 3)]
)
def test_small_tensors_are_read_together(tmp_path, monkeypatch, small, group):
    """The blocks of small tensors are read in groups, one `read_ranges` call each, and every
    other block alone; grouping changes no byte."""
    monkeypatch.setattr(blocks, "SMALL_BYTES", small)
    monkeypatch.setattr(blocks, "GROUP_BLOCKS", group)
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", 256)
    base_dir, task_dirs, base, tasks = build_model_set(tmp_path, kind="llama")
    config = MergeConfig(base=str(base_dir), tasks=tuple(map(str, task_dirs)))
    job = driver.prepare(config)
    method, state = get_method("ram_plus"), job.initial_state()
    args = (job.layout, job.storage, method, job.params)
    calls: list[int] = []
    read_ranges = type(job.storage).read_ranges

    def counting(self, url_ranges, into=None, traffic=None):
        calls.append(len(url_ranges))
        return read_ranges(self, url_ranges, into, traffic)

    monkeypatch.setattr(type(job.storage), "read_ranges", counting)
    totals: dict[str, np.ndarray] = {}
    for unit in job.units:
        with worker.worker_context().work() as scope:
            result = reduce_step.reduce_unit(
                unit, worker.TaskContext(*args, state), 0, False, scope
            )
        reduce_step.add_up(result, totals, {})
    sums = {key: torch.from_numpy(value) for key, value in totals.items()}
    state = method.finalize(RoundTotals(0, sums, job.params, job.numel(), state))
    calls.clear()
    data = b"".join(_map(unit, *args, state).tobytes() for unit in job.units)
    unit_blocks = [
        [
            blocks.Block(k, lo, hi)
            for k, p in enumerate(u.pieces)
            for lo, hi in blocks._blocks(p.numel, job.layout.tensors[p.tensor])
        ]
        for u in job.units
    ]
    groups = [
        blocks._groups(b, u.pieces, job.layout) for b, u in zip(unit_blocks, job.units, strict=True)
    ]
    assert len(calls) == sum(map(len, groups))  # one call per group
    assert all(len(g) <= group for gs in groups for g in gs)
    pieces = [p for u in job.units for p in u.pieces]
    alone = [not blocks._groupable(job.layout.tensors[p.tensor]) for p in pieces]
    if small == 0:
        assert all(alone) and len(calls) == sum(map(len, unit_blocks))
    else:
        assert not all(alone) and len(calls) < sum(map(len, unit_blocks))
    expected, _ = reference_merge(base, tasks, "ram_plus")
    names = [p.tensor for u in job.units for p in u.pieces]
    assert len(set(names)) == len(names)  # one piece per tensor: the bytes are in their order
    assert data == b"".join(
        expected[n].reshape(-1).view(torch.uint8).numpy().tobytes() for n in names
    )


def test_reduce_statistics_pickle_as_a_few_stacked_arrays():
    """A reduce task's statistics keep their keys, order, shapes and values across a pickle,
    which holds one array per shape and dtype (not one per key)."""
    import pickle

    stats = unit_results.Statistics(
        {f"t{i}": np.full((3, 3), i, np.int64) for i in range(1000)}
        | {"scalar": np.array(5, np.int64), "row": np.arange(4), "last": np.ones((3, 3), int)}
    )
    _, (keys, which, stacks) = stats.__reduce__()
    assert keys == list(stats) and len(which) == len(stats) and len(stacks) == 3
    back = pickle.loads(pickle.dumps(stats))
    assert isinstance(back, unit_results.Statistics) and list(back) == list(stats)
    for key, value in stats.items():
        assert isinstance(back[key], np.ndarray) and back[key].dtype == value.dtype
        assert back[key].shape == value.shape and np.array_equal(back[key], value)
