"""What the `MergeMethod` protocol lets a method declare, each checked through the engine on a
real Ray or at the check that uses it: whole rows per chunk, integer statistics only, how many
task models it merges, and parameters of its own scope under a name other methods use."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from builders import build_model_set, load_checkpoint

from ram_dist import methods
from ram_dist.api import run_merge
from ram_dist.errors import RamDistError
from ram_dist.methods import exact_sums
from ram_dist.methods.parameters import PARAMETERS, Parameter, check_flag, check_table
from ram_dist.methods.protocol import ChunkWork, NoStatistics, State, TensorParams
from ram_dist.planning.config import MergeConfig, check_task_count


@dataclass(frozen=True)
class RowShift(NoStatistics):
    """Each row of the base moved by the exact mean of task 1's change over that row: a rule
    of whole rows, which a chunk cut inside a row could not compute."""

    name: str = "row_shift"

    def whole_rows(self, params: TensorParams) -> bool:
        return True

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk = work.chunk
        assert chunk.start % chunk.row == 0 and base.numel() % chunk.row == 0, chunk
        b = base.to(torch.float32).reshape(-1, chunk.row)
        d = tasks[0].to(torch.float32).reshape(-1, chunk.row) - b
        _, sums = exact_sums.row_sums(d, torch.ones_like(d), chunk.start, chunk.row)
        means = [exact_sums.value(s) / chunk.row for s in sums]
        shift = torch.tensor(means, dtype=torch.float64).to(torch.float32).reshape(-1, 1)
        return (b + shift).reshape(-1)


@dataclass(frozen=True)
class FloatSum(NoStatistics):
    """A method that sums floats in a reduce round: refused by the engine."""

    name: str = "float_sum"
    rounds: int = 1

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return True

    def chunk_statistics(self, work, base, tasks):
        return {work.chunk.tensor: tasks[0].to(torch.float32).sum().reshape(1)}

    def merge_chunk(self, work, base, tasks):
        return base.to(torch.float32)


@pytest.fixture
def registered(monkeypatch):
    """This module's methods in the table (Ray sends them to the workers by value)."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        for method in (RowShift(), FloatSum()):
            monkeypatch.setitem(methods.METHODS, method.name, method)
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)


def _row_shift_reference(base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    b = base.to(torch.float32).numpy().astype(np.float64)
    rows = b.reshape(b.shape[0], -1) if b.ndim > 1 else b.reshape(1, -1)
    d = task.to(torch.float32).numpy().astype(np.float64).reshape(rows.shape) - rows
    import math

    shift = [np.float32(math.fsum(r) / rows.shape[1]) for r in d]  # d: float32 - float32, exact
    out = rows.astype(np.float32) + np.array(shift, dtype=np.float32).reshape(-1, 1)
    return torch.from_numpy(out.reshape(base.shape)).to(base.dtype)


@pytest.mark.usefixtures("ray_local", "registered")
@pytest.mark.parametrize("unit_budget_bytes", [300, 5000, 1 << 20])
def test_whole_rows_reach_the_method_at_any_budget(tmp_path, unit_budget_bytes):
    """Units and compute blocks hold whole rows (one row over the budget stays whole), so the
    rule of whole rows gives the reference's bytes at every budget."""
    base_dir, task_dirs, base, tasks = build_model_set(tmp_path / "in", base_dtype=torch.float32)
    out = tmp_path / "out"
    config = MergeConfig(
        base=str(base_dir), tasks=tuple(map(str, task_dirs)), method="row_shift", out=str(out),
        unit_budget_bytes=unit_budget_bytes,
    )  # fmt: skip
    run_merge(config)
    merged = load_checkpoint(out)
    for name, b in base.items():
        if b.is_floating_point():
            want = _row_shift_reference(b, tasks[0][name])
            assert torch.equal(merged[name].view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.usefixtures("ray_local", "registered")
def test_a_float_statistic_is_refused_naming_the_method(tmp_path):
    base_dir, task_dirs, _, _ = build_model_set(tmp_path / "in")
    config = MergeConfig(
        base=str(base_dir), tasks=tuple(map(str, task_dirs)), method="float_sum",
        out=str(tmp_path / "out"),
    )  # fmt: skip
    with pytest.raises(Exception, match="merge method float_sum: reduce statistic .* is float32"):
        run_merge(config)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    ("counts", "needs_base", "given", "message"),
    [
        ((1, 1), True, 2, "slerpish merges exactly one task model with the base; got 2"),
        ((1, 1), True, 0, "slerpish merges exactly one task model with the base; got 0"),
        ((2, None), True, 1, "slerpish merges two or more task models with the base; got 1"),
        ((2, 3), False, 4, "slerpish merges two to three task models; got 4"),
    ],
)
def test_task_counts_are_the_methods(counts, needs_base, given, message):
    method = SimpleNamespace(name="slerpish", task_counts=counts, needs_base=needs_base)
    with pytest.raises(RamDistError, match=message):
        check_task_count(method, given)
    check_task_count(method, counts[0])


def test_a_name_may_mean_two_things_each_with_a_flag_of_its_own():
    """A name is read one way everywhere; a flag means one thing (its help and scope)."""
    once = Parameter("epsilon", 1e-5, "a threshold", cli_flag="--eps")
    width = Parameter("epsilon", 0.0, "a width per task", per_task=True, cli_flag="--b-epsilon")
    check_table({"a": (once,), "b": (width,)})
    with pytest.raises(ValueError, match="read differently"):
        check_table(
            {"a": (once,), "b": (Parameter("epsilon", "x", "", kind=str, cli_flag="--eps"),)}
        )
    with pytest.raises(ValueError, match="flag --eps sets both epsilon and eps2"):
        check_table({"a": (once,), "b": (Parameter("eps2", 1.0, "", cli_flag="--eps"),)})
    with pytest.raises(ValueError, match=r"flag --eps means two things .* \(--b-epsilon\)"):
        check_table({"a": (once,), "b": (replace(width, cli_flag="--eps"),)})


@pytest.mark.parametrize(
    ("flag", "name", "method", "own"),
    [
        ("--eps", "epsilon", "della", "--della-epsilon"),
        ("--della-epsilon", "epsilon", "ram_plus", "--eps"),
        ("--t", "t", "nearswap", "--nearswap-t"),
        ("--nearswap-t", "t", "slerp", "--t"),
        ("--lambda", "lambda", "consensus_ta", "--consensus-lambda"),
        ("--consensus-lambda", "lambda", "ties", "--lambda"),
    ],
)
def test_a_flag_of_another_meaning_is_refused_naming_the_methods_own(flag, name, method, own):
    owners = ", ".join(m for m, ps in PARAMETERS.items() for p in ps if p.cli_flag == flag)
    meaning = next(p.help for p in PARAMETERS[method] if p.name == name)
    with pytest.raises(RamDistError) as refused:
        check_flag(flag, name, method)
    assert (
        str(refused.value)
        == f"{flag} sets {name} for {owners}; {method}'s {name} ({meaning}) is {own}"
    )
    check_flag(own, name, method)  # the method's own flag
    check_flag(flag, name, "passthrough")  # a method without the parameter: the reader notes it
