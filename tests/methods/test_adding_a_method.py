"""docs/extending.md's "Adding a method" example, run as written: its module, registered as its
one table line would register it, merged by the engine on a real Ray (reduce and map passes,
any chunking) with no engine change, and its bytes checked against the rule computed here
independently."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from builders import build_model_set, load_checkpoint

from ram_dist import methods
from ram_dist.api import run_merge
from ram_dist.methods import registry
from ram_dist.planning.config import MergeConfig

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
EXTENDING = ROOT / "docs" / "extending.md"

pytestmark = pytest.mark.usefixtures("ray_local")


def _example_source() -> str:
    text = EXTENDING.read_text()
    match = re.search(r"<!-- example-method -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/extending.md lost its example method"
    return match.group(1)


@pytest.fixture
def mean_method(tmp_path, monkeypatch):
    """The example's module, imported from a file, and its METHODS added to the table as its
    one line in `registry.py` would add them (Ray ships it to the workers by value: they
    cannot import a file only this process has)."""
    path = tmp_path / "mean_example.py"
    path.write_text(_example_source())
    spec = importlib.util.spec_from_file_location("mean_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mean_example", module)
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    # The table with the example's line added, built as `registry.METHODS` is (its checks
    # of names and flags included), then put in place of the one every module imported.
    table = registry._table(tuple(methods.METHODS.values()), module.METHODS)
    try:
        for name, method in table.items():
            monkeypatch.setitem(methods.METHODS, name, method)
        yield module.METHODS[0]
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.parametrize("unit_budget_bytes", [700, 1 << 20])
def test_readme_example_method_merges_exactly(tmp_path, mean_method, unit_budget_bytes) -> None:
    base_dir, task_dirs, base, tasks = build_model_set(tmp_path / "in", seed=3)
    out = tmp_path / "out"
    report = run_merge(
        MergeConfig(
            base=str(base_dir),
            tasks=tuple(map(str, task_dirs)),
            method="mean",
            out=str(out),
            unit_budget_bytes=unit_budget_bytes,
        )
    ).data
    assert report["method"] == "mean"
    merged = load_checkpoint(out)
    assert merged.keys() == base.keys()
    floating = 0
    for name, b in base.items():
        if not b.is_floating_point():
            assert torch.equal(merged[name], b)
            continue
        floating += 1
        b32 = b.to(torch.float32).numpy()
        deltas = [t[name].to(torch.float32).numpy() - b32 for t in tasks]
        total = np.zeros_like(b32) + deltas[0]
        for d in deltas[1:]:
            total = total + d
        want = torch.from_numpy(b32 + total / np.float32(len(tasks))).to(b.dtype)
        got = merged[name]
        assert got.dtype == b.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert floating > 0
