"""slerp, nuslerp, multislerp and karcher through the whole engine on a real local Ray: the
same bytes as the spec's reference (`geometric_reference`, which never imports ram_dist) at
several unit budgets and worker counts."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from builders import load_checkpoint
from geometric_models import build_geometric_models
from geometric_reference import karcher, multislerp, nuslerp, slerp

from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

pytestmark = [
    pytest.mark.usefixtures("ray_local"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    return build_geometric_models(tmp_path_factory.mktemp("geo"))


def _np(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy()


def _reference(method: str, params: dict, base: dict, tasks: list[dict]) -> dict:
    out = {}
    for name, b in base.items():
        ts = [_np(t[name]) for t in tasks]
        if method == "slerp":
            merged = slerp(_np(b), ts[0], params["t"])
        elif method == "nuslerp":
            flatten = params.get("nuslerp_flatten", True)
            row_wise = params.get("nuslerp_row_wise", False)
            merged = nuslerp(_np(b), ts, params["weight"], flatten, row_wise)
        elif method == "multislerp":
            merged = multislerp(_np(b), ts, params["weight"])
        else:
            merged = karcher(ts)
        out[name] = torch.from_numpy(np.ascontiguousarray(merged, dtype=np.float32))
    return out


CASES = {
    "slerp": ({"t": 0.3}, [1]),
    "nuslerp": ({"weight": [0.3, 0.9]}, [1, 2]),
    "nuslerp-rows": ({"weight": [0.3, 0.9], "nuslerp_flatten": False}, [1, 2]),
    "nuslerp-columns": (
        {"weight": [0.3, 0.9], "nuslerp_flatten": False, "nuslerp_row_wise": True},
        [1, 2],
    ),
    "multislerp": ({"weight": [0.5, 1.0, 0.7]}, [0, 1, 2]),
    "karcher": ({}, [0, 1, 2]),
}


def _run(base_dir, task_dirs, method, params, out, budget, workers, kernels) -> dict:
    per_task = {k: v for k, v in params.items() if k == "weight"}
    config = MergeConfig(
        base=str(base_dir),
        tasks=tuple(map(str, task_dirs)),
        out=str(out),
        method=method,
        parameters={k: v for k, v in params.items() if k != "weight"},
        task_parameters=tuple({"weight": w} for w in per_task.get("weight", []))
        or tuple({} for _ in task_dirs),
        unit_budget_bytes=budget,
        workers=workers,
        kernels=kernels,
    )
    return run_merge(config).data


@pytest.mark.parametrize("case", list(CASES))
def test_same_bytes_as_the_reference_at_any_split(models, tmp_path, case):
    base_dir, task_dirs, base, tasks = models
    params, picked = CASES[case]
    method = case.split("-")[0]
    chosen_dirs = [task_dirs[i] for i in picked]
    expected = _reference(method, params, base, [tasks[i] for i in picked])
    digests = set()
    # the fused Gram kernel on the CPUs (auto), and the eager rule
    splits = [(20000, 2, "auto"), (2**20, 1, "eager")]
    splits += [(3000, 1, "auto")] if case == "multislerp" else []
    for budget, workers, kernels in splits:
        out = tmp_path / f"out-{budget}-{workers}"
        report = _run(base_dir, chosen_dirs, method, params, out, budget, workers, kernels)
        merged = load_checkpoint(out)
        assert merged.keys() == expected.keys()
        for name, want in expected.items():
            got = merged[name]
            assert got.dtype == torch.float32, name
            differ = int((got.view(torch.int32) != want.view(torch.int32)).sum())
            assert differ == 0, f"{name}: {differ} elements differ from the reference"
        fused = report["passes"]["map"]["fused_elements"]
        assert (fused > 0) == (kernels == "auto" and case in ("slerp", "nuslerp", "multislerp",
                                                               "karcher")), fused  # fmt: skip
        files = sorted(out.glob("*.safetensors"))
        digests.add(tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files))
    assert len(digests) == 1
    if method == "slerp":  # the norms' weights move little: linear; the matrices: spherical
        assert 0 < report["slerp"]["tensors_blended_linearly"] < len(expected)
    if method == "karcher":
        assert report["karcher"]["most_iterations_of_a_tensor"] >= 1


def test_bfloat16_inputs_and_output(tmp_path_factory, tmp_path):
    """bf16 checkpoints: values decoded exactly to float32 (raw bits on the fused path),
    merged in float32, written as bf16 (the base's dtype) by rounding the reference's float32
    result to nearest even."""
    base_dir, task_dirs, base, tasks = build_geometric_models(
        tmp_path_factory.mktemp("geo-bf16"), torch.bfloat16
    )
    for case in ("multislerp", "nuslerp-rows"):
        params, picked = CASES[case]
        method = case.split("-")[0]
        expected = _reference(method, params, base, [tasks[i] for i in picked])
        for kernels in ("auto", "eager"):
            out = tmp_path / f"{case}-{kernels}"
            _run(base_dir, [task_dirs[i] for i in picked], method, params, out, 20000, 2, kernels)
            merged = load_checkpoint(out)
            for name, want in expected.items():
                got = merged[name]
                assert got.dtype == torch.bfloat16, name
                assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
