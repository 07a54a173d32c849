"""The engine holds objects, not argument lists: no function of `ram_dist/engine` takes more
than six parameters (a pass's context is a `PassContext`, a task's a `TaskContext`)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "ram_dist" / "engine"
MOST = 6


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_engine_function_takes_more_than_six_parameters():
    wide = [
        f"{path.name}: {node.name} ({len(_parameters(node))})"
        for path in sorted(ENGINE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(_parameters(node)) > MOST
    ]
    assert wide == []


def test_the_parts_are_planned_once_per_pass_context_and_kept_by_nothing_else(tmp_path):
    """The parts of a job's output (every shard's header: seconds for 100k tensors) are
    made once for both passes of a `PassContext`, and live as long as it does: no module of
    the engine keeps them from one job to the next."""
    from builders import build_model_set

    from ram_dist.engine import driver, passes
    from ram_dist.engine.pass_context import PartPlan, PassContext
    from ram_dist.engine.runtime import Cluster
    from ram_dist.planning.config import MergeConfig

    base_dir, task_dirs, _, _ = build_model_set(tmp_path, kind="llama")
    config = MergeConfig(base=str(base_dir), tasks=tuple(map(str, task_dirs)))
    job = driver.prepare(config)
    context = PassContext(job, Cluster(cpus=1, gpus=0, embedded=False), min_part_bytes=0)
    plan = context.part_plan()
    assert context.part_plan(0) is plan
    assert context.part_plan(1 << 20) is not plan
    assert PassContext(job, context.cluster).part_plan() is not plan  # another job's context
    assert plan == PartPlan.of(job, 0)
    units = [u for group in plan.unit_groups() for u in group]
    assert sorted(u.index for u in units) == sorted(u.index for u in job.units)
    kept = [
        n for n, v in vars(passes).items()
        if not n.startswith("__") and isinstance(v, (list, dict, set)) and v
    ]  # fmt: skip
    assert kept == []
