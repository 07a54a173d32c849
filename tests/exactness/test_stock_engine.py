"""model_stock (and filter_wise), sce, arcee_fusion, nearswap and passthrough through the
whole engine on a real local Ray: the independent reference's bytes
(`support/stock_reference.py`) at two unit budgets, one and two workers, the fused and the
eager path, the same file bytes for every split."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import stock_reference as ref
import torch
from builders import assert_same_bytes, build_model_set, load_checkpoint

from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

#: (unit budget bytes, workers, kernels): a few rows per unit on two workers with the fused
#: exact sums where numba is installed; everything in one unit on the eager (torch) path.
SPLITS = [(3000, 2, "auto"), (2**22, 1, "eager")]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("models")
    return build_model_set(
        root, base_dtype=torch.float32, densities=(0.9, 0.5, 1.0), base_shard="100KB", seed=3
    )


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


CASES = [
    ("model_stock", 3, {}, {}),
    ("model_stock", 2, {"filter_wise": True}, {"filter_wise": True}),
    ("sce", 3, {"select_topk": 0.3}, {"select_topk": 0.3}),
    ("arcee_fusion", 1, {}, {}),
    ("nearswap", 1, {"t": 0.003}, {"t": 0.003}),
    ("passthrough", 1, {}, {"scale": 0.5}),
    ("passthrough", 1, {}, {"scale": 1.0}),  # fused: a copy of the model's bytes
]


@pytest.mark.parametrize(("method", "n", "params", "reference_params"), CASES, ids=lambda c: str(c))
def test_engine_gives_the_reference_bytes_at_any_split(
    models, tmp_path, method, n, params, reference_params
):
    base_dir, task_dirs, base, tasks = models
    tasks, task_dirs = tasks[-n:], task_dirs[-n:]
    task_parameters = ()
    if method == "passthrough":  # the layout from the model itself; its scale per task
        base_dir = task_dirs[0]
        task_parameters = ({"scale": reference_params["scale"]},)
    expected = ref.merge(method, base, tasks, reference_params)
    digests = set()
    for budget, workers, kernels in SPLITS:
        out = tmp_path / f"{budget}-{workers}"
        run_merge(
            MergeConfig(
                base=str(base_dir), tasks=tuple(map(str, task_dirs)), out=str(out),
                method=method, parameters=params, task_parameters=task_parameters,
                unit_budget_bytes=budget, workers=workers, kernels=kernels,
            )
        )  # fmt: skip
        assert_same_bytes(load_checkpoint(out), expected)
        digests.add(_digest(out))
    assert len(digests) == 1


@pytest.mark.parametrize(
    ("method", "n", "extra", "key", "line"),
    [
        ("model_stock", 2, [], "model_stock", "model_stock t: "),
        ("sce", 3, ["--select-topk", "0.5"], "sce", "sce: 21 tensors selected by variance"),
        ("arcee_fusion", 1, [], "arcee_fusion", "arcee_fusion: thresholds over 21 tensors"),
    ],
)
def test_the_command_prints_what_each_method_reports(
    models, tmp_path, capsys, method, n, extra, key, line
):
    import json

    from ram_dist.cli import main

    base_dir, task_dirs, _, _ = models
    out = tmp_path / "out"
    argv = ["merge", "--base", str(base_dir), "--out", str(out), "--method", method, *extra]
    for task in task_dirs[-n:]:
        argv += ["--task", str(task)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "merge_report.json").read_text())
    assert report["method"] == method
    if key is not None:
        assert key in report and line in printed
    card = (out / "README.md").read_text()
    assert f"(`{method}`)" in card
