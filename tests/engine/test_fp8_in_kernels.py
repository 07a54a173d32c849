"""The worker functions run inline (no Ray) on FP8 checkpoints with the fused kernels on:
RAM's kernels read every FP8 input as stored and write the FP8 output themselves, so no
input is ever dequantized into a float32 copy (`Fp8Source.decode` is never called), and the
bytes are the spec's reference's (`fp8_reference`), for an FP8 base with FP8 or bf16
agents, a bf16 base with FP8 agents, and `out_dtype`. A method whose kernels read float32
values (TIES) still gets them decoded, with the same reference bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8_models import BLOCK, build_fp8_set
from fp8_reference import reference_fp8_merge

from ram_dist.dtypes import itemsize
from ram_dist.engine import blocks, driver, map_step, reduce_step, worker
from ram_dist.io.sinks import DriverTarget
from ram_dist.methods import get_method
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.sources import Fp8Source
from ram_dist.planning.units import Part

pytest.importorskip("numba")

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

FUSED = worker.WorkFlags(fused=True)
SETS = {
    "fp8": dict(base_format="fp8", task_formats=("fp8", "fp8", "fp8")),
    "fp8-base-bf16-agent": dict(base_format="fp8", task_formats=("fp8", "fp8", "bf16")),
    "bf16-base-fp8-agents": dict(base_format="bf16", task_formats=("fp8", "bf16", "fp8")),
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8-kernels")
    return {name: build_fp8_set(root / name, **spec) for name, spec in SETS.items()}


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """Elements of FP8 inputs dequantized into float32 copies, counted."""
    counts: list[int] = []
    decode = Fp8Source.decode

    def counting(self, start, stop, read, floats, base):
        counts.append(stop - start)
        return decode(self, start, stop, read, floats, base)

    monkeypatch.setattr(Fp8Source, "decode", counting)
    return counts


def _merge_inline(s, method_name: str, flags=FUSED, **kw) -> dict[str, bytes]:
    """Both passes, unit by unit in this process; the output tensors' bytes by name."""
    config = MergeConfig(
        base=str(s.base_dir), tasks=tuple(str(t) for t in s.task_dirs), method=method_name,
        unit_budget_bytes=700, **kw,
    )  # fmt: skip
    job = driver.prepare(config)
    method, state = get_method(method_name), job.initial_state()
    for round_ in range(method.rounds):
        totals: dict[str, np.ndarray] = {}
        for unit in job.units:
            with worker.worker_context().work() as scope:
                context = worker.TaskContext(
                    job.layout, job.storage, method, job.params, state, flags
                )
                got = reduce_step.reduce_unit(unit, context, round_, False, scope)
            reduce_step.add_up(got, totals, {})
        sums = {key: torch.from_numpy(value) for key, value in totals.items()}
        state = method.finalize(round_, sums, job.params, job.numel(), state)
    pieces: dict[str, list[tuple[int, bytes]]] = {}
    for unit in job.units:
        part = Part(unit.shard, 1, (unit.index,), 0, map_step.unit_out_bytes(unit, job.layout))
        work = map_step.PartWork(part, (unit,), b"", DriverTarget("inline"))
        context = worker.TaskContext(job.layout, job.storage, method, job.params, state, flags)
        data = map_step.map_part(work, context).receipt.data.tobytes()
        at = 0
        for p in unit.pieces:
            size = p.numel * itemsize(job.layout.tensors[p.tensor].out_dtype)
            pieces.setdefault(p.tensor, []).append((p.start, data[at : at + size]))
            at += size
    return {name: b"".join(b for _, b in sorted(parts)) for name, parts in pieces.items()}


def _expected(s, method: str, out_dtype: torch.dtype | None = None, **kw) -> dict[str, bytes]:
    want, _ = reference_fp8_merge(s.base, s.tasks, method, BLOCK, out_dtype=out_dtype, **kw)
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for n, t in want.items()}  # fmt: skip


@pytest.mark.parametrize("which", list(SETS))
def test_ram_reads_and_writes_fp8_in_its_kernels(sets, which, decoded, monkeypatch):
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", 16 * 45 * 2)  # several blocks a unit
    got = _merge_inline(sets[which], "ram_plus")
    assert got == _expected(sets[which], "ram_plus")
    assert decoded == []  # no FP8 input was dequantized into a float32 copy


def test_out_dtype_from_fp8_inputs_in_the_kernels(sets, decoded):
    got = _merge_inline(sets["fp8"], "ram", out_dtype="bfloat16")
    assert got == _expected(sets["fp8"], "ram", torch.bfloat16)
    assert decoded == []


def test_a_method_that_reads_values_still_gets_them_decoded(sets, decoded):
    """TIES's kernels read float32 values: the FP8 inputs are dequantized for them, and the
    bytes are the eager path's (`test_fp8_checkpoints` checks them against the rule)."""
    s = sets["fp8-base-bf16-agent"]
    got = _merge_inline(s, "ties", parameters={"density": 0.5})
    assert sum(decoded) > 0
    assert got == _merge_inline(s, "ties", worker.EAGER, parameters={"density": 0.5})
