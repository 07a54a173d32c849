"""Adapter tasks in whole jobs, as for any task: read from moto's S3 server, the output
verified, a rerun found complete, a changed adapter config refused at the old output, and
`probe` naming the adapters. The adapters are written by PEFT (`support/peft_adapters.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import build_tiny_base, load_checkpoint, merge_config
from peft_adapters import build_adapter

from ram_dist import api
from ram_dist.api import run_merge
from ram_dist.errors import RamDistError

BUCKET = "ram-dist-adapters"
Q_V = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, fs) -> dict:
    """A tiny Qwen2 base, two PEFT adapters and a third task made of one of them by PEFT's
    merge, local and uploaded to the bucket."""
    root = tmp_path_factory.mktemp("adapters")
    base = root / "base"
    build_tiny_base(base, kind="qwen2")
    one = build_adapter(base, root / "one", r=4, lora_alpha=8, target_modules=Q_V, seed=1)
    two = build_adapter(base, root / "two", r=2, lora_alpha=3, target_modules=("down_proj",),
                        use_rslora=True, seed=2)  # fmt: skip
    for d in (base, one, two):
        fs.put(str(d), f"{BUCKET}/in/{d.name}", recursive=True)
    return {
        "local": (base, [one, two]),
        "s3": (f"s3://{BUCKET}/in/base", [f"s3://{BUCKET}/in/one", f"s3://{BUCKET}/in/two"]),
    }


@pytest.mark.usefixtures("ray_s3")
def test_adapters_in_a_bucket_merge_to_the_local_bytes(inputs, options, fs, tmp_path):
    base, tasks = inputs["local"]
    run_merge(merge_config(base, tasks, tmp_path / "local", unit_budget_bytes=2048))
    run_merge(merge_config(*inputs["s3"], f"s3://{BUCKET}/out", options, unit_budget_bytes=2048))
    fs.get(f"{BUCKET}/out", str(tmp_path / "fetched"), recursive=True)
    local, remote = load_checkpoint(tmp_path / "local"), load_checkpoint(tmp_path / "fetched")
    assert local.keys() == remote.keys()
    for name, tensor in local.items():
        assert tensor.view(torch.uint8).equal(remote[name].view(torch.uint8)), name


@pytest.mark.usefixtures("ray_s3")
def test_verify_rerun_and_a_changed_adapter(inputs, tmp_path):
    """`verify` passes; the same job again finds the output complete; the same adapter folder
    with another lora_alpha is another input, refused at the old output."""
    base, tasks = inputs["local"]
    out = tmp_path / "out"
    run_merge(merge_config(base, tasks, out))
    assert api.verify(out).ok
    again = run_merge(merge_config(base, tasks, out)).data
    assert again["already_complete"] is True
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in tasks[0].iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    config = json.loads((changed / "adapter_config.json").read_text())
    config["lora_alpha"] = 16
    (changed / "adapter_config.json").write_text(json.dumps(config))
    moved = tmp_path / "moved"
    out.rename(moved)
    run_merge(merge_config(base, [changed, tasks[1]], tmp_path / "other"))
    with pytest.raises(RamDistError, match="holds a merge of other inputs or parameters"):
        run_merge(merge_config(base, [changed, tasks[1]], moved))


@pytest.mark.usefixtures("ray_s3")
def test_plan_probe_and_report_name_the_adapters(inputs, tmp_path):
    base, tasks = inputs["local"]
    plan = api.plan(base=str(base), tasks=[str(t) for t in tasks], out=str(tmp_path / "o"))
    words = [i["format"] for i in plan.data["formats"]["inputs"]]
    assert words[1] == "PEFT LoRA adapter (r=4, lora_alpha=8, target_modules=q_proj,v_proj)"
    assert words[2] == "PEFT LoRA adapter (r=2, lora_alpha=3, rslora, target_modules=down_proj)"
    probe = api.probe(base=str(base), tasks=[str(t) for t in tasks],
                      json_path=str(tmp_path / "probe.json"))  # fmt: skip
    assert [i["format"] for i in probe.data["formats"]["inputs"]] == words
    stats = probe.data["tasks"]
    assert all(t["density"] > 0 for t in stats)  # each adapter changed its targets' weights
    report = run_merge(merge_config(base, tasks, tmp_path / "m")).data
    assert [i["format"] for i in report["formats"]["inputs"]] == words
    card = (Path(tmp_path / "m") / "README.md").read_text()
    assert "PEFT LoRA adapter (r=4, lora_alpha=8, target_modules=q_proj,v_proj)" in card
