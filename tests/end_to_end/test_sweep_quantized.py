"""Sweeps over quantized bases: a block-FP8 base (FP8 and bf16 agents) and a
compressed-tensors INT4/INT8 base (`pack-quantized`, bf16 agents as trainers save them).
Each variant of a sweep across RAM+, TIES, DELLA, task arithmetic, model_stock and
consensus TIES is byte for byte the single merge with its method and parameters, and verifies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from compressed_models import INT_SCHEMES, build_set
from fp8_models import build_fp8_set

import ram_dist
from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

METHODS = ["ram_plus", "ties", "della", "task_arithmetic", "model_stock", "consensus_ties"]
GRID = {"r": [0.1, 0.2], "density": [0.5]}
#: Each variant's single merge: its method and the grid's values it takes.
SINGLES: dict[str, tuple[str, dict[str, Any]]] = {
    "ram_plus-r0.1": ("ram_plus", {"r": 0.1}),
    "ram_plus-r0.2": ("ram_plus", {"r": 0.2}),
    "ties-density0.5": ("ties", {"density": 0.5}),
    "della-density0.5": ("della", {"density": 0.5}),
    "task_arithmetic": ("task_arithmetic", {}),
    "model_stock": ("model_stock", {}),
    "consensus_ties-density0.5": ("consensus_ties", {"density": 0.5}),
}
#: A few rows of the widest weight a unit: every quantized weight spans several units.
UNIT = 2000


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, tuple[Path, list[Path]]]:
    fp8 = build_fp8_set(tmp_path_factory.mktemp("fp8"), task_formats=("fp8", "bf16", "fp8"))
    int4 = build_set(tmp_path_factory.mktemp("int"), INT_SCHEMES, densities=(0.01, 0.01, 0.02))
    return {"fp8": (fp8.base_dir, fp8.task_dirs), "int4": (int4.base_dir, int4.agent_dirs)}


def _config(base: Path, tasks: list[Path], out: Path, **kw: Any) -> MergeConfig:
    return MergeConfig(
        base=str(base), tasks=tuple(map(str, tasks)), out=str(out), unit_budget_bytes=UNIT, **kw
    )


def _files(folder: Path) -> dict[str, bytes]:
    """The weights, index, config and mergekit config of an output, by name."""
    names = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    names += [folder / n for n in ("model.safetensors.index.json", "config.json")]
    names.append(folder / "mergekit_config.yml")
    return {p.name: p.read_bytes() for p in names if p.exists()}


@pytest.mark.parametrize("which", ["fp8", "int4"])
def test_each_variant_of_a_quantized_base_is_its_single_merge(inputs, tmp_path, which):
    base, tasks = inputs[which]
    report = run_merge(_config(base, tasks, tmp_path / "sweep", methods=METHODS, grid=GRID)).data
    assert [v["name"] for v in report["variants"]] == list(SINGLES)
    for v in report["variants"]:
        method, params = SINGLES[v["name"]]
        one = tmp_path / "one" / v["name"]
        run_merge(_config(base, tasks, one, method=method, parameters=params))
        got, want = _files(Path(v["out"])), _files(one)
        assert set(got) == set(want) and len(got) >= 3, v["name"]
        for name in want:
            assert got[name] == want[name], (which, v["name"], name)
        assert ram_dist.verify(v["out"]).ok, v["name"]
