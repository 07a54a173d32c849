"""`ram_dist.synthetic`, the builder of the demo, the tests and the benchmarks: its layouts
are the real ones, and what it writes is what ram-dist and safetensors read back."""

from __future__ import annotations

import json

import pytest
import torch
from builders import build_tiny_base, load_checkpoint
from safetensors import safe_open

from ram_dist.io.checkpoint import open_checkpoint
from ram_dist.io.storage import Storage
from ram_dist.synthetic.files import plan_shards, write_shards, write_sparse_checkpoint
from ram_dist.synthetic.llama import LLAMA_3_1_405B, TINY, LlamaDims
from ram_dist.synthetic.weights import base_state, base_tensor


def test_tiny_layout_is_the_one_transformers_writes(tmp_path):
    state = build_tiny_base(tmp_path / "llama", "llama", torch.float32)
    assert {n: tuple(t.shape) for n, t in state.items()} == dict(TINY.tensors())
    assert TINY.params == sum(t.numel() for t in state.values()) == 106_816
    written = json.loads((tmp_path / "llama" / "config.json").read_text())
    ours = TINY.config()
    same = ("architectures", "model_type", "hidden_size", "intermediate_size", "vocab_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")  # fmt: skip
    assert {k: written[k] for k in same} == {k: ours[k] for k in same}


def test_llama_405b_layout():
    # 126 layers of 9 tensors, the embedding, the final norm and lm_head.
    assert len(LLAMA_3_1_405B.tensors()) == 1137
    assert LLAMA_3_1_405B.kv_dim == 1024
    assert LLAMA_3_1_405B.params == 405_853_388_800


@pytest.mark.parametrize("params", [0.005e9, 0.1e9, 0.5e9, 1e9])
def test_dims_for_a_parameter_count(params):
    dims = LlamaDims.for_params(params)
    assert abs(dims.params / params - 1) < 0.03
    assert dims.hidden == 64 * dims.heads and dims.kv_dim == 64 * dims.kv_heads


def test_base_tensor_depends_on_seed_and_name_only():
    shapes = [("model.norm.weight", (4096,)), ("w", (64, 64))]
    state = base_state(reversed(shapes), seed=3, dtype=torch.float32)
    assert torch.equal(state["w"], base_tensor("w", (64, 64), 3, torch.float32))
    assert not torch.equal(state["w"], base_tensor("w", (64, 64), 4, torch.float32))
    norm = state["model.norm.weight"]
    assert abs(norm.mean().item() - 1) < 0.01 and 0.04 < norm.std().item() < 0.06
    assert abs(state["w"].std().item() - 0.02) < 0.002


def test_shards_are_written_in_the_planned_order(tmp_path):
    state = {n: torch.full((k + 1,), float(k)) for k, n in enumerate("abcde")}
    shards = plan_shards([(n, t.numel() * 4) for n, t in state.items()], max_shard_bytes=12)
    assert shards == [["a", "b"], ["c"], ["d"], ["e"]]  # 4 + 8 bytes; then 12, 16, 20 alone
    asked: list[str] = []
    write_shards(tmp_path, shards, lambda n: asked.append(n) or state[n])
    assert asked == list("abcde")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * 15
    assert index["weight_map"]["b"] == "model-00001-of-00004.safetensors"
    assert index["weight_map"]["e"] == "model-00004-of-00004.safetensors"
    loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[n], t) for n, t in state.items())
    with pytest.raises(ValueError, match="one shard"):
        write_shards(tmp_path / "single", shards, state.__getitem__, single_file=True)


def test_sparse_checkpoint_has_real_headers_and_no_data(tmp_path):
    shards = [[("a", (4, 3))], [("b", (5,)), ("c", (2, 2))]]
    write_sparse_checkpoint(tmp_path, shards)
    ckpt = open_checkpoint(str(tmp_path), "base", Storage())
    assert ckpt.sharded and len(ckpt.files) == 2
    assert {n: (t.dtype, t.shape, t.end - t.start) for n, t in ckpt.tensors.items()} == {
        "a": ("BF16", (4, 3), 24),
        "b": ("BF16", (5,), 10),
        "c": ("BF16", (2, 2), 8),
    }
    second = tmp_path / "model-00002-of-00002.safetensors"
    with safe_open(str(second), "pt") as f:
        assert sorted(f.keys()) == ["b", "c"]
        assert torch.equal(f.get_tensor("c"), torch.zeros(2, 2, dtype=torch.bfloat16))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 24 + 10 + 8
