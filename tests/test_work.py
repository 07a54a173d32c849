"""The worker functions run inline (no Ray): compute blocks and units change no byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import build_model_set
from reference import reference_merge, reference_stats

from ram_dist.config import MergeConfig
from ram_dist.engine import driver, work
from ram_dist.methods import get_method


@pytest.mark.parametrize("reuse_output", [False, True])
@pytest.mark.parametrize("block", [7, 1000, 1 << 22])
def test_units_and_compute_blocks_reassemble_the_reference(
    tmp_path, monkeypatch, block, reuse_output
):
    monkeypatch.setattr(work, "COMPUTE_BLOCK", block)
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
        with work.worker_context().task() as scope:
            result = work.reduce_unit(unit, *args, state, 0, False, scope)
        work.add_up(result, totals, {})
    sums = {key: torch.from_numpy(value) for key, value in totals.items()}
    state = method.finalize(0, sums, job.params, job.numel(), state)
    ref = reference_stats(base, tasks)
    histograms = [t["histogram"] for t in state["summary"]["tasks"]]
    assert histograms == [list(map(int, h)) for h in ref["H"]]

    blobs: dict[str, list[bytes]] = {}
    previous = None
    for unit in job.units:
        result = work.map_unit(unit, *args, state, reuse_output=reuse_output).data
        if previous is not None:  # the worker's buffer is used again, or fresh memory is
            assert np.shares_memory(result, previous) == reuse_output
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
