"""`benchmarks.method_table`: every registry method is benchmarked, and each YAML it writes
is one both tools accept, with the same parameters (no merge is run)."""

from __future__ import annotations

from pathlib import Path

import mergekit.merge_methods as mergekit_methods
import pytest
from mergekit.config import MergeConfiguration

from benchmarks import method_table as mt
from ram_dist.mergekit_config import parse_mergekit_config
from ram_dist.methods.registry import METHODS

MODELS = Path("/nonexistent/models")


def test_every_registry_method_is_benchmarked() -> None:
    assert set(METHODS) | {mt.LORA} == set(mt.METHODS)


@pytest.mark.parametrize("method", sorted(mt.METHODS))
def test_both_tools_accept_the_same_merge(method: str) -> None:
    tasks = mt.agents(MODELS, method)
    ours = mt.config(method, MODELS, tasks, "ramdist")
    spec = parse_mergekit_config(ours, "bench.yaml")
    assert spec.merge_method == ("ram_plus" if method == mt.LORA else method)
    theirs_name = mt.METHODS[method].mergekit_name(method)
    if theirs_name is None:
        assert theirs_name not in {m.spec.name for m in mergekit_methods.registered_methods()}
        return
    theirs = mt.config(method, MODELS, tasks, "mergekit")
    MergeConfiguration.model_validate(theirs)
    assert mergekit_methods.get(theirs["merge_method"]) is not None
    # the same models with the same per-model parameters; top-level ones differ only
    # where mergekit's method takes fewer (RAM+ against mergekit's ram)
    assert theirs["models"] == ours["models"]
    assert theirs.get("base_model") == ours.get("base_model")
    assert theirs.get("parameters", {}).items() <= ours.get("parameters", {}).items()
