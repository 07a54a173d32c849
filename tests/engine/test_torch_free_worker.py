"""A CPU worker on the fused path imports neither torch nor anything that does: it reads
the inputs into numpy arrays and the kernels merge them. Run here as a worker runs them (the
task functions, with the job's pickled arguments) in a process where `import torch` fails,
and checked against the reference; an eager method in the same process fails on its import,
which shows that the block is real."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from builders import build_model_set
from reference import reference_merge

from ram_dist import kernels
from ram_dist.engine import driver
from ram_dist.engine.map_step import PartWork
from ram_dist.engine.passes import work_flags
from ram_dist.methods.protocol import RoundTotals
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed")

WORKER = """
import pickle, sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
args = pickle.load(open(sys.argv[1], "rb"))
from ram_dist.engine import map_step, pool, reduce_step, worker  # what a Ray worker imports
from ram_dist.io.sinks import DriverTarget
from ram_dist.planning.units import Part
worker.warm_up()
out = {}
for round_ in range(args["method"].rounds):
    context = worker.TaskContext(args["layout"], args["storage"], args["method"],
                                 args["params"], args["state"], args["flags"])
    r = reduce_step.reduce_group(args["units"], context, round_, True)
    out["stats"] = {k: v.tolist() for k, v in r.stats.items()}
    out["nonfinite"] = r.nonfinite
for unit in args["units"]:
    part = Part(unit.shard, 1, (unit.index,), 0, map_step.unit_out_bytes(unit, args["layout"]))
    work = map_step.PartWork(part, (unit,), b"", DriverTarget("inline"))
    context = worker.TaskContext(args["layout"], args["storage"], args["method"],
                                 args["params"], args["final"], args["flags"])
    r = map_step.map_part(work, context)
    out.setdefault("data", []).append(r.receipt.data.tobytes())
    out.setdefault("fused", []).append(r.fused_elements)
out["torch"] = "torch" in sys.modules and sys.modules["torch"] is not None
pickle.dump(out, open(sys.argv[2], "wb"))
"""


def _job(tmp_path, method: str, **kw):
    base_dir, task_dirs, base, tasks = build_model_set(tmp_path, kind="qwen2")
    config = MergeConfig(
        base=str(base_dir),
        tasks=tuple(map(str, task_dirs)),
        method=method,
        unit_budget_bytes=4000,
        **kw,
    )
    return driver.prepare(config), base, tasks


def _run_worker(tmp_path, args: dict) -> dict:
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "args.pkl"), str(tmp_path / "out.pkl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads((tmp_path / "out.pkl").read_bytes())


def test_fused_ram_plus_worker_runs_without_torch(tmp_path) -> None:
    job, base, tasks = _job(tmp_path, "ram_plus")
    method, state = job.method, job.initial_state()
    # the final state as the driver computes it from the statistics (in this process)
    expected, stats = reference_merge(base, tasks, "ram_plus")
    final = _final_state(job)
    args = {
        "units": tuple(job.units), "layout": job.layout, "storage": job.storage,
        "method": method, "params": job.params, "state": state, "final": final,
        "flags": work_flags(job),
    }  # fmt: skip
    got = _run_worker(tmp_path, args)
    assert got["torch"] is False
    assert got["nonfinite"] is None
    merged = b"".join(got["data"])
    want = b"".join(
        expected[p.tensor].reshape(-1)[p.start : p.stop].view(torch.uint8).numpy().tobytes()
        for u in job.units
        for p in u.pieces
    )
    assert merged == want
    participating = sum(
        p.numel for u in job.units for p in u.pieces if job.layout.tensors[p.tensor].participating
    )
    assert sum(got["fused"]) == participating > 0  # every merged element went to the kernel


def test_eager_method_in_the_same_worker_needs_torch(tmp_path) -> None:
    """With `--kernels eager` (the eager rule), the same worker fails on `import torch`."""
    job, _, _ = _job(tmp_path, "ram_plus", kernels="eager")
    state = job.initial_state()
    args = {
        "units": tuple(job.units[:1]), "layout": job.layout, "storage": job.storage,
        "method": job.method, "params": job.params, "state": state, "final": state,
        "flags": work_flags(job),
    }  # fmt: skip
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    (tmp_path / "worker.py").write_text(WORKER)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "worker.py"), str(tmp_path / "args.pkl"), "-"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "import of torch halted" in done.stderr  # uncaught ImportError


def _final_state(job) -> dict:
    """The method's state after its reduce rounds, computed inline with the kernels off."""
    from ram_dist.engine.reduce_step import add_up, reduce_unit
    from ram_dist.engine.worker import TaskContext, worker_context

    state = job.initial_state()
    for round_ in range(job.method.rounds):
        totals: dict[str, np.ndarray] = {}
        for unit in job.units:
            with worker_context().work() as scope:
                context = TaskContext(job.layout, job.storage, job.method, job.params, state)
                r = reduce_unit(unit, context, round_, False, scope)
            add_up(r, totals, {})
        sums = {k: torch.from_numpy(v) for k, v in totals.items()}
        state = job.method.finalize(RoundTotals(round_, sums, job.params, job.numel(), state))
    return state


UNPICKLE = """
import pickle, sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
work = pickle.load(open(sys.argv[1], "rb"))
p, t = work.part, work.target
print(repr((
    type(work).__name__, (p.shard, p.number, p.units, p.start, p.stop),
    [(u.index, u.shard, [(x.tensor, x.start, x.stop) for x in u.pieces]) for u in work.units],
    work.header, type(t).__name__, t.url, t.partial,
)))
print(sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "torch" and v))
"""


def test_part_task_pickles_without_torch_types(tmp_path) -> None:
    """A map task's own argument holds no torch object either: a real `PartWork` of a job's
    map pass (its part, units, the shard's header and a file target) is unpickled, with its
    every field, in a process where `import torch` fails."""
    from ram_dist.engine.pass_context import PartPlan
    from ram_dist.io.sinks.file import FileSink

    job, _, _ = _job(tmp_path, "ram_plus")
    shard = next(iter(job.layout.shards))
    units, headers, plan = PartPlan.of(job, FileSink.min_part_bytes).of_shards([shard])
    part = plan[shard][0]
    target = (
        FileSink(str(tmp_path / "out"), job.storage, "test")
        .open(shard, plan[shard][-1].stop, plan[shard], None)
        .target
    )
    work = PartWork(part, tuple(units[i] for i in part.units), headers[shard], target)
    assert part.number == 1 and work.units and work.header  # part 1 holds the shard's header
    data = pickle.dumps(work)
    assert b"torch" not in data
    assert pickle.loads(data) == work
    (tmp_path / "work.pkl").write_bytes(data)
    done = subprocess.run(
        [sys.executable, "-c", UNPICKLE, str(tmp_path / "work.pkl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fields, loaded = done.stdout.splitlines()
    want = (
        "PartWork", (part.shard, part.number, part.units, part.start, part.stop),
        [(u.index, u.shard, [(x.tensor, x.start, x.stop) for x in u.pieces]) for u in work.units],
        work.header, "FileTarget", target.url, target.partial,
    )  # fmt: skip
    assert fields == repr(want)
    assert loaded == "[]"  # nothing of torch was imported to rebuild it
