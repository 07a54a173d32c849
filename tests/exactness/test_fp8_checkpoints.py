"""Fine-grained FP8 checkpoints merged by the spec, end to end on a real local Ray.

The expected bytes come from `fp8_reference` (the spec's FP8 rules in plain torch, whole
tensors) on top of `reference` (the RAM rule): never from ram_dist. The baselines, whose
own references live elsewhere, are checked through the same FP8 rules: merging FP8 inputs
must give exactly the requantized merge of their dequantized values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import load_checkpoint
from fp8_models import BLOCK, UNTOUCHED, WEIGHTS, build_fp8_set
from fp8_reference import SCALE, reference_fp8_merge, stored_output, values, write
from method_cases import case_id, every_method, task_count

from ram_dist import api
from ram_dist.api import run_merge
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

SETS = {
    "fp8": dict(base_format="fp8", task_formats=("fp8", "fp8", "fp8")),
    "fp8-base-bf16-agent": dict(base_format="fp8", task_formats=("fp8", "fp8", "bf16")),
    "bf16-base-fp8-agents": dict(base_format="bf16", task_formats=("fp8", "bf16", "fp8")),
    "bf16-scales": dict(base_format="fp8", task_formats=("fp8", "fp8"), densities=(0.1, 0.4)),
}
#: One element a unit (so one band of an FP8 weight), a few bands, every tensor in one unit.
BUDGETS = {"one-row": 4, "some-bands": 700, "whole": 10**8}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, spec in SETS.items():
        scale = torch.bfloat16 if name == "bf16-scales" else torch.float32
        out[name] = build_fp8_set(root / name, scale_dtype=scale, **spec)
    return out


def _merge(s, out: Path | str, **kw) -> dict:
    config = MergeConfig(
        base=str(s.base_dir), tasks=tuple(str(t) for t in s.task_dirs), out=str(out), **kw
    )
    return run_merge(config).data


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        a, b = _bytes(got), _bytes(want)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} bytes differ"


CASES = [("fp8", b) for b in BUDGETS] + [
    (which, b) for which in SETS if which != "fp8" for b in ("some-bands", "whole")
]


@pytest.mark.parametrize("which, budget", CASES)
def test_ram_plus_equals_the_reference(sets, tmp_path, which, budget):
    s = sets[which]
    report = _merge(s, tmp_path / "out", method="ram_plus", unit_budget_bytes=BUDGETS[budget])
    expected, stats = reference_fp8_merge(s.base, s.tasks, "ram_plus", BLOCK)
    _assert_same(load_checkpoint(tmp_path / "out"), expected)
    # The statistics count the FP8 weights' elements, never their scales.
    assert report["elements"]["participating"] == stats["d"]
    assert stats["d"] == sum(v.numel() for v in values(s.base, BLOCK).values())
    for t, task in enumerate(report["tasks"]):
        assert task["histogram"] == [int(v) for v in stats["H"][t]]
    assert report["lambda_applied"] == stats["lambda32"]


@pytest.mark.parametrize("method", ["ram", "ram_plus_soft"])
def test_ram_variants_on_the_eager_path(sets, tmp_path, method):
    s = sets["fp8-base-bf16-agent"]
    report = _merge(s, tmp_path / "out", method=method, kernels="eager", unit_budget_bytes=300)
    assert report["passes"]["map"]["fused_elements"] == 0
    expected, _ = reference_fp8_merge(s.base, s.tasks, method, BLOCK)
    _assert_same(load_checkpoint(tmp_path / "out"), expected)


def test_blocks_no_agent_touched_keep_the_base_bytes_and_scale(sets, tmp_path):
    s = sets["fp8"]
    _merge(s, tmp_path / "out", unit_budget_bytes=BUDGETS["some-bands"])
    got = load_checkpoint(tmp_path / "out")
    bm, bn = BLOCK
    for name, blocks in UNTOUCHED.items():
        q, base_q = got[name].view(torch.uint8), s.base[name].view(torch.uint8)
        for band, col in blocks:
            rows, cols = slice(band * bm, (band + 1) * bm), slice(col * bn, (col + 1) * bn)
            assert torch.equal(q[rows, cols], base_q[rows, cols])
            assert got[name + SCALE][band, col] == s.base[name + SCALE][band, col]
        # and the merge did change other blocks of the same weight
        assert not torch.equal(got[name + SCALE], s.base[name + SCALE])


@pytest.mark.parametrize("case", every_method(rows=True), ids=case_id)
def test_every_method_merges_the_dequantized_values(sets, tmp_path, case):
    """Every method of the registry: FP8 inputs give exactly the FP8 requantization of the
    same method's merge of their dequantized values (written as float32 checkpoints, merged
    in float32), whatever the method needs: exact sums, selections, whole rows (della,
    filter_wise, nuslerp per row)."""
    method, params = case
    s = sets["fp8-base-bf16-agent"]
    tasks = s.task_dirs[: task_count(method, len(s.task_dirs))]
    plain = tmp_path / "plain"
    write(values(s.base, BLOCK), plain / "base", None)
    for i, t in enumerate(s.tasks[: len(tasks)]):
        write(values(t, BLOCK), plain / f"t{i}", None)
    kw = dict(method=method, parameters=params, unit_budget_bytes=2000)
    run_merge(MergeConfig(base=str(s.base_dir), tasks=tuple(map(str, tasks)),
                          out=str(tmp_path / "fp8-out"), **kw))  # fmt: skip
    config = MergeConfig(
        base=str(plain / "base"),
        tasks=tuple(str(plain / f"t{i}") for i in range(len(tasks))),
        out=str(tmp_path / "f32-out"),
        **kw,
    )
    run_merge(config)
    merged = load_checkpoint(tmp_path / "f32-out")
    # The plain bf16 tensors were merged into float32 there; here they stay bf16 as written.
    f32 = {n: v if n in WEIGHTS else v.to(torch.bfloat16) for n, v in merged.items()}
    _assert_same(load_checkpoint(tmp_path / "fp8-out"), stored_output(f32, s.base, BLOCK, None))


def test_out_dtype_writes_a_dequantized_checkpoint(sets, tmp_path):
    s = sets["fp8-base-bf16-agent"]
    _merge(s, tmp_path / "out", out_dtype="bfloat16", unit_budget_bytes=300)
    expected, _ = reference_fp8_merge(s.base, s.tasks, "ram_plus", BLOCK, torch.bfloat16)
    got = load_checkpoint(tmp_path / "out")
    assert not [n for n in got if n.endswith(SCALE)]
    _assert_same(got, expected)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "fine-grained FP8 (e4m3, 16x8 blocks, 4 FP8 weights" in card
    assert "| **merged model** | bfloat16 |" in card


def test_fp8_output_keeps_the_config_and_says_its_format(sets, tmp_path):
    s = sets["fp8"]
    report = _merge(s, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(BLOCK)
    formats = report["formats"]
    assert [f["role"] for f in formats["inputs"]] == ["base model", "task 1", "task 2", "task 3"]
    assert all(f["format"].startswith("fine-grained FP8 (e4m3, 16x8") for f in formats["inputs"])
    assert formats["output"].startswith("fine-grained FP8 (e4m3, 16x8 blocks, 4 FP8 weights")
    # The scales follow their weights in the output shards; the index names every tensor.
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(s.base)
    assert api.verify(tmp_path / "out").ok


def test_plan_shows_each_input_format(sets, tmp_path):
    s = sets["bf16-base-fp8-agents"]
    planned = api.plan(base=s.base_dir, tasks=s.task_dirs, out=tmp_path / "out")
    formats = planned.data["formats"]
    assert formats["inputs"][0]["format"] == "bfloat16"
    assert formats["inputs"][1]["format"].startswith("fine-grained FP8")
    assert formats["inputs"][2]["format"] == "bfloat16"
    assert formats["output"] == "bfloat16"


def test_probe_says_the_formats_in_text_json_and_markdown(sets, capsys):
    from ram_dist.cli import main
    from ram_dist.report.figures import markdown_summary

    s = sets["fp8-base-bf16-agent"]
    argv = ["probe", "--base", str(s.base_dir)] + [
        a for t in s.task_dirs for a in ("--task", str(t))
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "formats:\n  base model: fine-grained FP8 (e4m3, 16x8 blocks" in printed
    assert "  task 3: bfloat16\n  output: fine-grained FP8" in printed
    report = api.probe(base=s.base_dir, tasks=s.task_dirs).data
    assert report["formats"]["inputs"][3] == {"role": "task 3", "format": "bfloat16"}
    assert "- formats: base model: fine-grained FP8" in markdown_summary(report)


def test_through_the_driver(sets, tmp_path):
    """An output no worker can write (memory://): the parts come back through the driver."""
    import fsspec

    s = sets["fp8"]
    out = "memory://fp8-through-driver/out"
    report = _merge(s, out, unit_budget_bytes=BUDGETS["some-bands"])
    m = report["passes"]["map"]
    assert m["output_path"] == "through-driver" and m["bytes_written_by_workers"] == 0
    fs = fsspec.filesystem("memory")
    local = tmp_path / "copy"
    fs.get("/fp8-through-driver/out", str(local), recursive=True)
    expected, _ = reference_fp8_merge(s.base, s.tasks, "ram_plus", BLOCK)
    _assert_same(load_checkpoint(local), expected)


def test_a_dequantized_tiny_llama_loads_and_runs_in_transformers(tmp_path):
    """A tiny Llama stored as DeepSeek-style FP8 (every linear layer's weight in 16 x 16
    blocks; embeddings, norms and lm_head in bf16), and agents in FP8 and bf16; merged to
    bfloat16, it loads in transformers and runs, with the reference's weights."""
    from builders import build_tiny_base, make_agents
    from fp8_reference import quantize
    from transformers import AutoModelForCausalLM

    block = (16, 16)
    base_dir = tmp_path / "base"
    base = build_tiny_base(base_dir)
    linear = [n for n, t in base.items() if t.ndim == 2 and "proj" in n]
    assert linear

    def fp8(state: dict) -> dict:
        out = dict(state)
        for n in linear:
            out[n], out[n + SCALE] = quantize(state[n].float(), block)
        return out

    agents = make_agents(base, (0.1, 0.3), seed=5)
    stored = [fp8(base), fp8(agents[0]), agents[1]]
    folders = [tmp_path / "fp8-base", tmp_path / "t0", tmp_path / "t1"]
    for state, folder, quantized in zip(stored, folders, (True, True, False), strict=True):
        write(state, folder, block if quantized else None)
        for f in base_dir.iterdir():  # the tokenizer and generation config of the base
            if f.name.startswith(("tokenizer", "generation", "special", "chat")):
                (folder / f.name).write_bytes(f.read_bytes())
        config = json.loads((base_dir / "config.json").read_text())
        if quantized:
            config["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block),
            }  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run_merge(
        MergeConfig(base=str(folders[0]), tasks=(str(folders[1]), str(folders[2])),
                    out=str(out), out_dtype="bfloat16")
    )  # fmt: skip
    expected, _ = reference_fp8_merge(stored[0], stored[1:], "ram_plus", block, torch.bfloat16)
    _assert_same(load_checkpoint(out), expected)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 42]])).logits
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()


def test_fp8_blocks_of_other_heights(tmp_path):
    """A base in 16x8 blocks and tasks in 8x8 (fitting its bands) or 12x8 blocks (not): the
    first merges to FP8 as the reference says; the second is refused by name while the output
    would keep FP8 blocks, and merges to bf16 (cut where both sets of bands are whole)."""
    from reference import reference_merge

    base = build_fp8_set(tmp_path / "a", task_formats=("fp8",), densities=(0.3,))
    two = {"task_formats": ("fp8", "fp8"), "densities": (0.2, 0.5)}
    fits = build_fp8_set(tmp_path / "b", block=(8, 8), **two)
    odd = build_fp8_set(tmp_path / "c", block=(12, 8), **two)
    fits_tasks = [values(t, (8, 8)) for t in fits.tasks]
    tasks = tuple(str(t) for t in fits.task_dirs)
    for budget in (4, 700):
        out = tmp_path / f"fits{budget}"
        run_merge(MergeConfig(base=str(base.base_dir), tasks=tasks, out=str(out),
                              method="ram_plus", unit_budget_bytes=budget))  # fmt: skip
        merged, _ = reference_merge(values(base.base, BLOCK), fits_tasks, "ram_plus")
        expected = stored_output(merged, base.base, BLOCK, None)
        _assert_same(load_checkpoint(out), expected)
    odd_tasks = tuple(str(t) for t in odd.task_dirs)
    config = MergeConfig(base=str(base.base_dir), tasks=odd_tasks, out=str(tmp_path / "odd"))
    with pytest.raises(
        Exception, match=r"FP8 blocks of 12 rows in task 1 .* do not fit the 16-row"
    ):
        run_merge(config)
    out = tmp_path / "odd-bf16"
    run_merge(MergeConfig(base=str(base.base_dir), tasks=odd_tasks, out=str(out),
                          unit_budget_bytes=700, out_dtype="bfloat16"))  # fmt: skip
    merged, _ = reference_merge(values(base.base, BLOCK), [values(t, (12, 8)) for t in odd.tasks],
                                "ram_plus", out_dtype=torch.bfloat16)  # fmt: skip
    _assert_same(load_checkpoint(out), merged)
