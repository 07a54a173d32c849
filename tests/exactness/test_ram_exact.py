"""End to end on a real local Ray: merged bytes equal the independent whole-tensor reference."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from builders import (
    DTYPE_SETS,
    assert_same_bytes,
    build_model_set,
    load_checkpoint,
    save_checkpoint,
)
from reference import reference_merge

from ram_dist.api import run_merge
from ram_dist.io.writer import json_text
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

METHODS = ["ram", "ram_plus", "ram_plus_soft"]


@pytest.fixture(scope="module")
def model_sets(tmp_path_factory) -> dict:
    """Tiny Llama/Qwen2 bases (sharded by transformers) and three agents sharded otherwise."""
    sets = {}
    for name, spec in DTYPE_SETS.items():
        root = tmp_path_factory.mktemp(name)
        sets[name] = build_model_set(root, base_shard="100KB", task_shard=70_000, **spec)
    return sets


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _merge(base, tasks, out, **kw) -> dict:
    config = MergeConfig(base=str(base), tasks=tuple(str(t) for t in tasks), out=str(out), **kw)
    return run_merge(config).data


def _assert_stats_match(report: dict, ref: dict) -> None:
    assert report["elements"]["participating"] == ref["d"]
    assert report["elements"]["unchanged"] == ref["unchanged"]
    for t, task in enumerate(report["tasks"]):
        assert task["histogram"] == [int(v) for v in ref["H"][t]]
        assert task["unique"] == ref["unique"][t]
        assert task["shared"] == ref["shared"][t]
        rho = float("inf") if task["rho"] == "inf" else task["rho"]
        assert rho == ref["rho"][t]
    assert report["lambda_applied"] == ref["lambda32"]


#: The fused CPU kernels (`auto`) for every method on every dtype set; plain torch (`eager`)
#: for every method and on every dtype set, each once (the eager rule has no per-method
#: dtype handling: a method's own part is its lambda).
CASES = [(m, d, "auto") for m in METHODS for d in DTYPE_SETS] + [
    ("ram", "bf16", "eager"),
    ("ram_plus", "fp16", "eager"),
    ("ram_plus_soft", "fp32", "eager"),
    ("ram_plus_soft", "mixed", "eager"),
]


@pytest.mark.parametrize(("method", "dtypes", "kernels"), CASES)
def test_bytes_equal_reference(model_sets, tmp_path, method, dtypes, kernels):
    """Both paths: the fused CPU kernels (`auto`) and plain torch (`eager`)."""
    base_dir, task_dirs, base, tasks = model_sets[dtypes]
    report = _merge(
        base_dir,
        task_dirs,
        tmp_path / "out",
        method=method,
        unit_budget_bytes=4096,
        kernels=kernels,
    )
    merged_elements = sum(t.numel() for t in base.values() if t.is_floating_point())
    fused = report["passes"]["map"]["fused_elements"]
    assert fused == (merged_elements if kernels == "auto" else 0)
    expected, ref_stats = reference_merge(base, tasks, method)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), expected)
    _assert_stats_match(report, ref_stats)
    densities = [t["density"] for t in report["tasks"]]
    assert densities[0] < 0.05 and 0.35 < densities[1] < 0.5 and 0.45 < densities[2] < 0.6
    assert all(0 < t["unique"] and 0 < t["shared"] for t in report["tasks"])


def test_out_dtype_float32_and_base_layout_mirrored(model_sets, tmp_path):
    base_dir, task_dirs, base, tasks = model_sets["mixed"]
    _merge(base_dir, task_dirs, tmp_path / "out", out_dtype="float32")
    expected, _ = reference_merge(base, tasks, "ram_plus", out_dtype=torch.float32)
    assert_same_bytes(load_checkpoint(tmp_path / "out"), expected)
    shards = sorted(p.name for p in base_dir.glob("*.safetensors"))
    assert len(shards) > 1
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == shards
    base_index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    out_index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert out_index["weight_map"] == base_index["weight_map"]
    sizes = sum(t.numel() * t.element_size() for t in expected.values())
    assert out_index["metadata"]["total_size"] == sizes


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.suffix == ".safetensors" or p.name.endswith("index.json")
    }


def test_unit_budget_and_worker_count_do_not_change_bytes(model_sets, tmp_path):
    base_dir, task_dirs, base, tasks = model_sets["mixed"]
    expected, _ = reference_merge(base, tasks, "ram_plus")
    digests = {}
    # Every budget, each worker count at small and large budgets, and both counts at one. The
    # smallest, 1000 bytes (250 elements of the float32 task), cuts every matrix into several
    # units, mid-row (rows of 64): about 600 units a pass, where a 256-byte budget (one row)
    # made 1675, each a Ray task, for the same property.
    runs = [(1000, 2), (4096, 1), (65_536, 2), (256 * 2**20, 1), (256 * 2**20, 2)]
    for budget, workers in runs:
        out = tmp_path / f"out-{budget}-{workers}"
        report = _merge(base_dir, task_dirs, out, unit_budget_bytes=budget, workers=workers)
        digests[(budget, workers)] = _digest(out)
        for pass_name in ("reduce", "map"):
            assert max(report["passes"][pass_name]["max_unit_bytes_read_per_input"]) <= budget
    assert len({tuple(sorted(d.items())) for d in digests.values()}) == 1
    assert_same_bytes(load_checkpoint(tmp_path / "out-1000-2"), expected)


def test_tensor_larger_than_budget_is_read_in_pieces(model_sets, tmp_path):
    base_dir, task_dirs, base, _ = model_sets["bf16"]
    budget = 4096
    report = _merge(base_dir, task_dirs, tmp_path / "out", unit_budget_bytes=budget)
    embed = base["model.embed_tokens.weight"]
    assert embed.numel() * 2 > 4 * budget  # the embedding needs several units
    for pass_name in ("reduce", "map"):
        stats = report["passes"][pass_name]
        per_input = stats["max_unit_bytes_read_per_input"]
        assert len(per_input) == 4 and all(0 < b <= budget for b in per_input)
        big = [t.numel() * 2 for t in base.values() if t.numel() * 2 > budget]
        assert stats["units"] >= sum(-(-n // budget) for n in big)
    total_in = sum(t.numel() * t.element_size() for t in base.values()) * 4
    assert report["passes"]["reduce"]["bytes_read"] == total_in
    assert report["passes"]["map"]["bytes_read"] == total_in


def _edge_states() -> tuple[dict, list[dict], float]:
    """Hand-made tensors for the spec's edge cases."""
    eps = float(torch.tensor(1e-5, dtype=torch.float32))
    base = {
        "w": torch.tensor([[0.0, 1.0, 2.0], [3.0, -0.0, 5.0]], dtype=torch.float32),
        "vec": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16),
        "scalar": torch.tensor(0.5, dtype=torch.float32),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
        "flag": torch.tensor([True, False]),
    }
    # task 1 changes nothing (and has other integer values, which must be ignored)
    t1 = {k: v.clone() for k, v in base.items()}
    t1["steps"] = torch.tensor([9, 9, 9])
    # task 2: only shared changes (every one also made by task 3); w[0,0] moves by exactly eps
    t2 = {k: v.clone() for k, v in base.items()}
    t2["w"] = torch.tensor([[eps, 1.5, 2.0], [3.0, -0.0, 6.0]], dtype=torch.float32)
    t2["scalar"] = torch.tensor(0.75, dtype=torch.float32)
    # task 3: the same shared changes plus unique ones
    t3 = {k: v.clone() for k, v in base.items()}
    t3["w"] = torch.tensor([[0.0, 2.5, 2.25], [3.0, -0.0, 7.0]], dtype=torch.float32)
    t3["scalar"] = torch.tensor(1.0, dtype=torch.float32)
    t3["vec"] = torch.tensor([1.0, 2.5, 3.0, 4.0], dtype=torch.bfloat16)
    return base, [t1, t2, t3], eps


@pytest.mark.parametrize("method", METHODS)
def test_spec_edge_cases(tmp_path, method):
    base, tasks, eps = _edge_states()
    dirs = []
    for i, state in enumerate([base, *tasks]):
        folder = tmp_path / f"in{i}"
        save_checkpoint(state, folder, max_shard_bytes=24 if i in (0, 2) else None)
        dirs.append(folder)
    # Task 1 changed an integer tensor: copied from the base only when asked (the spec).
    report = _merge(
        dirs[0], dirs[1:], tmp_path / "out", method=method, parameters={"epsilon": 1e-5},
        integers_from_base=True,
    )  # fmt: skip
    assert report["integers_from_base"]["copied_though_changed"] == ["steps"]
    merged = load_checkpoint(tmp_path / "out")
    expected, ref = reference_merge(base, tasks, method, eps=1e-5)
    assert_same_bytes(merged, expected)
    _assert_stats_match(report, ref)
    r, alpha = 0.1, 2.0
    t1, t2, t3 = report["tasks"]
    assert (t1["changed"], t1["rho"], report["lambda_applied"][0]) == (0, 0.0, 1.0)
    assert (t2["unique"], t2["shared"], t2["rho"]) == (0, 3, "inf")
    # Every JSON file written is valid JSON: no Infinity (rho) or NaN anywhere.
    for written in (tmp_path / "out").glob("*.json"):
        json.loads(written.read_text(), parse_constant=_no_constant)
    # ... also while the job runs: the manifest saved after the reduce pass holds the state
    # with rho as a float, written through the same writer.
    state = {"summary": {"tasks": [{"rho": float("inf")}, {"rho": float("nan")}]}}
    text = json_text(state)
    assert json.loads(text, parse_constant=_no_constant)["summary"]["tasks"] == [
        {"rho": "inf"},
        {"rho": "nan"},
    ]
    lam2 = {"ram": 1.0, "ram_plus": 1 + r * alpha, "ram_plus_soft": 1 + r}[method]
    assert report["lambda_applied"][1] == float(torch.tensor(lam2, dtype=torch.float32))
    assert (t3["unique"], t3["shared"]) == (2, 3)
    # |tau| == eps exactly: unchanged; shared: the mean; -0.0 kept; integers from the base.
    w = merged["w"]
    assert w[0, 0].item() == 0.0
    assert w[0, 1].item() == 1.0 + (0.5 + 1.5) / 2
    assert w[1, 2].item() == 5.0 + (1.0 + 2.0) / 2
    assert torch.signbit(w[1, 1]).item()
    assert merged["scalar"].item() == 0.5 + (0.25 + 0.5) / 2
    lam3 = report["lambda_applied"][2]
    assert merged["w"][0, 2].item() == float(torch.tensor(2.0) + torch.tensor(lam3) * 0.25)
    assert torch.equal(merged["steps"], base["steps"])
    assert torch.equal(merged["flag"], base["flag"])
    assert merged["vec"].dtype == torch.bfloat16


def test_merged_model_loads_in_transformers(model_sets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, task_dirs, base, tasks = model_sets["bf16"]
    _merge(base_dir, task_dirs, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    expected, _ = reference_merge(base, tasks, "ram_plus")
    state = model.state_dict()
    for name, want in expected.items():
        assert torch.equal(state[name], want), name
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 256)
    assert torch.isfinite(logits).all()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (base_dir / name).read_bytes()
    # Written in another dtype, the model says so: transformers loads it in that dtype.
    _merge(base_dir, task_dirs, tmp_path / "out32", out_dtype="float32")
    config = json.loads((tmp_path / "out32" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    model32 = AutoModelForCausalLM.from_pretrained(tmp_path / "out32", dtype="auto")
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
