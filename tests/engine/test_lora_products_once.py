"""Each LoRA adapter's product formed once per element per job (issue 43, point 3), in a job
where several passes read the values after the one that forms them (TIES's; not RAM+'s, one
later pass: `kept_values.MIN_LATER_READS`): the pass that forms a block's task values keeps
them (`engine.kept_values`) and every later pass (the reduce rounds after the first, the map
pass) takes them, where the budget has room. The
merged bytes are the same at any budget and any worker count: a block not kept is formed
again, by the same rule. The products are counted where they are formed (`LoraSource.decode`,
the only caller of the product kernel) and, on Ray, in `merge_report.json`
(`passes.<pass>.lora_products`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
from builders import build_tiny_base, make_task_state, save_checkpoint
from inline_passes import FUSED, merge_inline
from peft_adapters import build_adapter
from safetensors.torch import load_file
from stored_forms import count_decodes

from ram_dist.api import run_merge
from ram_dist.engine import driver
from ram_dist.engine.kept_values import MIN_LATER_READS, KeptValues, kept_for
from ram_dist.engine.worker import WorkFlags
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.job import Job
from ram_dist.planning.lora_sources import LoraSource

pytest.importorskip("numba")

#: Units of a few rows: many blocks, so that a small budget keeps some and not others.
UNIT_BUDGET = 2048
PARAMS = {"ties": {"density": 0.5}, "ram_plus": {}}


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory) -> dict:
    """A tiny bf16 Llama base, two PEFT adapters (r 8 and 16: products worth keeping,
    `lora_sources.KEEP_MIN_RANK`) and a full checkpoint."""
    root = tmp_path_factory.mktemp("lora-once")
    base_dir = root / "base"
    base = build_tiny_base(base_dir, kind="llama", dtype=torch.bfloat16)
    adapters = [
        build_adapter(base_dir, root / "a0", r=8, target_modules=("q_proj", "v_proj"), seed=1),
        build_adapter(base_dir, root / "a1", r=16, target_modules=("q_proj", "up_proj"), seed=2),
    ]
    save_checkpoint(make_task_state(base, 0.3, seed=7), root / "full", copy_from=base_dir)
    return {"base_dir": base_dir, "tasks": [*adapters, root / "full"], "root": root}


@pytest.fixture
def formed(monkeypatch) -> list[int]:
    """Elements whose LoRA product was formed, one entry per block."""
    return count_decodes(LoraSource, monkeypatch)


def _prepared(job: dict, method: str) -> Job:
    config = MergeConfig(base=str(job["base_dir"]), tasks=tuple(map(str, job["tasks"])),
                         method=method, parameters=PARAMS[method],
                         unit_budget_bytes=UNIT_BUDGET)  # fmt: skip
    return driver.prepare(config)


def _lora_elements(job: dict, method: str) -> int:
    """Elements of the job's LoRA task values: each adapter's targeted weights."""
    layout = _prepared(job, method).layout
    return sum(
        e.numel for e in layout.tensors.values() for s in e.sources if isinstance(s, LoraSource)
    )


def test_a_job_keeps_them_only_where_several_later_passes_read_them(lora_job):
    """RAM+ reads a LoRA task's values in one pass after the one that forms them (its map
    pass), where forming them again measured cheaper than keeping them: it keeps none. TIES
    reads them in four (three rounds, the map pass): its budget holds every element of the
    adapters' weights (ranks 8 and 16, both worth keeping), as bf16, the base's dtype."""
    assert _prepared(lora_job, "ram_plus").reduce_rounds < MIN_LATER_READS
    assert kept_for(_prepared(lora_job, "ram_plus")) is None
    ties = _prepared(lora_job, "ties")
    assert ties.reduce_rounds >= MIN_LATER_READS
    kept = kept_for(ties)
    assert kept is not None
    assert kept.budget_bytes == 2 * _lora_elements(lora_job, "ties")


@pytest.mark.parametrize("method", ["ties", "ram_plus"])
def test_same_bytes_at_any_budget_and_one_product_per_element(lora_job, formed, method):
    """Inline (every round and the map pass, unit by unit): without kept values every pass
    that reads a LoRA tensor forms its product again; with room for all, each element's is
    formed once; with room for some or none, in between; the bytes never change."""
    args = (lora_job["base_dir"], lora_job["tasks"], method)
    kw = {"parameters": PARAMS[method], "unit_budget_bytes": UNIT_BUDGET}
    plain = merge_inline(*args, FUSED, **kw)
    every_pass = sum(formed)
    elements = _lora_elements(lora_job, method)
    assert every_pass >= 2 * elements  # a reduce round and the map pass, at least
    seen = []
    for budget in (0, elements // 3, 10 * elements):
        formed.clear()
        kept = KeptValues(uuid.uuid4().hex, budget)
        got = merge_inline(*args, WorkFlags(fused=True, kept=kept), **kw)
        assert got == plain
        seen.append(sum(formed))
        kept.remove()
    assert seen[0] == every_pass
    assert elements < seen[1] < every_pass
    assert seen[2] == elements


def test_eager_path_keeps_the_same_bytes(lora_job, formed):
    args = (lora_job["base_dir"], lora_job["tasks"], "ties")
    kw = {"parameters": PARAMS["ties"], "unit_budget_bytes": UNIT_BUDGET}
    plain = merge_inline(*args, FUSED, **kw)
    kept = KeptValues(uuid.uuid4().hex, 1 << 30)
    assert merge_inline(*args, WorkFlags(kept=kept), **kw) == plain
    kept.remove()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("workers", [1, 2])
def test_on_ray_each_product_is_formed_once_and_nothing_is_left(lora_job, tmp_path, workers):
    """TIES on Ray (the check round and four rounds, then the map pass): the report counts
    each element's product formed once, in the first round, and taken as kept by every
    later pass; the bytes are the inline merge's without kept values; the job's folder of
    kept values is gone afterwards."""
    kw = {"parameters": PARAMS["ties"], "unit_budget_bytes": UNIT_BUDGET}
    expected = merge_inline(lora_job["base_dir"], lora_job["tasks"], "ties", FUSED, **kw)
    parent = Path(KeptValues("x", 0).root()).parent
    before = set(os.listdir(parent)) if parent.is_dir() else set()
    out = tmp_path / "out"
    config = MergeConfig(base=str(lora_job["base_dir"]), tasks=tuple(map(str, lora_job["tasks"])),
                         out=str(out), method="ties", workers=workers, **kw)  # fmt: skip
    report = run_merge(config).data
    elements = _lora_elements(lora_job, "ties")
    reduce, map_ = report["passes"]["reduce"], report["passes"]["map"]
    assert reduce["lora_products"]["formed"] == elements
    assert reduce["lora_products"]["reused"] > 0  # the rounds after the first
    assert map_["lora_products"] == {"formed": 0, "reused": elements}
    merged = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(f))
    for name, data in expected.items():
        assert merged[name].contiguous().view(torch.uint8).numpy().tobytes() == data, name
    assert (set(os.listdir(parent)) if parent.is_dir() else set()) <= before
