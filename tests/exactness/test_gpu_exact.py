"""On a machine with CUDA: every method gives the same bytes on the GPU workers
(`--device cuda`, the eager rule on the GPU) as on the CPUs (`--device cpu`, the fused
kernels where they apply), for bf16, fp16, fp32 and mixed inputs. Skipped without CUDA: the
scheduling is tested with fake GPUs in `tests/engine/test_devices.py`, where the GPU workers
compute on the CPU and so cannot tell whether CUDA rounds as the CPU does.
"""

from __future__ import annotations

import pytest
import torch
from builders import DTYPE_SETS, build_model_set

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

METHODS = [
    ("ram", {}),
    ("ram_plus", {}),
    ("ram_plus_soft", {}),
    ("ramplus_tl", {}),
    ("task_arithmetic", {"lambda": 0.8}),
    ("ties", {"density": 0.3}),
    ("ties", {"density": 0.3, "rescale": True}),
    ("dare_linear", {"density": 0.4}),
    ("dare_ties", {"density": 0.4}),
    ("consensus_ta", {"k": 2, "lambda": 0.5}),
    ("consensus_ties", {"density": 0.3, "k": 2, "lambda": 0.4, "rescale": True}),
    ("breadcrumbs_ties", {"density": 0.3, "gamma": 0.05, "rescale": True}),
    ("della", {"density": 0.4, "epsilon": 0.1}),
    ("della_linear", {"density": 0.4, "epsilon": 0.3, "rescale": False}),
    ("linear", {}),
    ("slerp", {"t": 0.3}),
    ("nuslerp", {"weight": 0.6}),
    ("nuslerp", {"weight": 0.6, "nuslerp_flatten": False}),
    ("multislerp", {"weight": 0.6}),
    ("karcher", {}),
]


@pytest.fixture(scope="module")
def model_sets(tmp_path_factory) -> dict:
    return {
        name: build_model_set(tmp_path_factory.mktemp(name), **spec)
        for name, spec in DTYPE_SETS.items()
    }


@pytest.mark.parametrize("dtypes", list(DTYPE_SETS))
@pytest.mark.parametrize(("method", "params"), METHODS)
def test_the_gpu_gives_the_cpus_bytes(ray_local, model_sets, tmp_path, dtypes, method, params):
    from ram_dist.api import run_merge
    from ram_dist.methods import get_method
    from ram_dist.planning.config import MergeConfig

    base, tasks = model_sets[dtypes][:2]
    most = get_method(method).task_counts[1]  # the first tasks, for a method that takes fewer
    tasks = tasks[:most] if most is not None else tasks
    shards = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        config = MergeConfig(
            base=str(base), tasks=tuple(map(str, tasks)), out=str(out), method=method,
            parameters=params, device=device, unit_budget_bytes=64 * 2**10,
        )  # fmt: skip
        report = run_merge(config).data
        shards[device] = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}
        on_gpu = report["passes"]["map"]["units_on_gpu"]
        assert on_gpu == (report["passes"]["map"]["units"] if device == "cuda" else 0)
    assert shards["cuda"] == shards["cpu"]
