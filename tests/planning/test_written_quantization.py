"""The `quantization_config` a mixed compressed-tensors base's output keeps
(`written_config.fp8_groups_only`): its packed INT weights are written in bfloat16, its FP8
ones FP8 again, so only the FP8 groups are left, and a module written in bfloat16 that a group
left would still target (by class, or by a regex or name) is ignored, as compressed-tensors
reads `ignore`. The configs are written by hand, as llm-compressor writes them."""

from __future__ import annotations

import copy

import pytest

from ram_dist.planning.written_config import fp8_groups_only

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
MLP = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def _config(fp8_targets: list[str], ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["re:.*mlp\\..*_proj"], "format": "pack-quantized",
                        "weights": INT4},
            "group_1": {"targets": fp8_targets, "format": "float-quantized", "weights": FP8},
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }  # fmt: skip


def test_the_int_groups_go_and_the_format_is_the_one_left():
    quant = _config(["re:.*self_attn\\..*_proj"], ["lm_head"])
    before = copy.deepcopy(quant)
    got = fp8_groups_only(quant, MLP)
    assert quant == before  # the base's config is not changed
    assert got == {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_1": quant["config_groups"]["group_1"]},
        "ignore": ["lm_head"],  # no FP8 target names an MLP module
        "kv_cache_scheme": None,
    }


def test_a_module_an_fp8_group_still_targets_is_ignored():
    # "Linear" is a class: every bf16 MLP module may be one
    got = fp8_groups_only(_config(["Linear"], ["lm_head"]), MLP)
    assert got["ignore"] == ["lm_head", *MLP]
    # a regex or a name that reaches one MLP module
    got = fp8_groups_only(_config(["re:model\\.layers\\.1\\.", MLP[0]], []), MLP)
    assert got["ignore"] == MLP
    # already ignored by a regex, or by its name: not again
    got = fp8_groups_only(_config(["Linear"], ["re:.*layers\\.0\\.mlp", MLP[1]]), MLP)
    assert got["ignore"] == ["re:.*layers\\.0\\.mlp", MLP[1]]
