"""`ram_dist.synthetic`, the builder of the demo, the tests and the benchmarks: its layouts
are the real ones, and what it writes is what ram-dist and safetensors read back."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from builders import build_tiny_base, load_checkpoint
from safetensors import safe_open

from ram_dist.dtypes import ITEMSIZE
from ram_dist.io.checkpoint import open_checkpoints
from ram_dist.io.storage import Storage
from ram_dist.planning.formats import recognize
from ram_dist.synthetic import gpt_oss
from ram_dist.synthetic.deepseek import DEEPSEEK_V3, DeepSeekDims, shard_name
from ram_dist.synthetic.files import plan_shards, write_shards, write_sparse_checkpoint
from ram_dist.synthetic.llama import LLAMA_3_1_405B, TINY, LlamaDims
from ram_dist.synthetic.weights import base_state, base_tensor

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


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
    ckpt = open_checkpoints([(str(tmp_path), "base")], Storage())[0]
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


def test_deepseek_v3_layout():
    """The published DeepSeek-V3: 91,991 tensors, 45,808 of them FP8 weights, each with its
    F32 block scales; the router, norms, embeddings, lm_head and the MTP module's own
    weights BF16 (the router's correction bias F32)."""
    tensors = DEEPSEEK_V3.tensors()
    by_name = {name: (shape, dtype) for name, shape, dtype in tensors}
    assert len(tensors) == len(by_name) == 91_991
    fp8 = [name for name, _, dtype in tensors if dtype == "F8_E4M3"]
    assert len(fp8) == 45_808
    assert DEEPSEEK_V3.params == 684_531_386_000
    for name in fp8:
        (rows, cols), scales = by_name[name][0], by_name[name + "_scale_inv"]
        assert scales == ((-(-rows // 128), -(-cols // 128)), "F32")
    assert sum(dtype == "F32" for _, _, dtype in tensors) == 45_808 + 59  # + the router biases
    assert by_name["model.layers.3.mlp.gate.weight"] == ((256, 7168), "BF16")
    assert by_name["model.layers.3.mlp.gate.e_score_correction_bias"] == ((256,), "F32")
    assert "model.layers.2.mlp.gate.weight" not in by_name  # the first 3 layers are dense
    assert by_name["model.layers.2.mlp.down_proj.weight"] == ((7168, 18432), "F8_E4M3")
    assert by_name["model.layers.2.mlp.down_proj.weight_scale_inv"] == ((56, 144), "F32")
    assert by_name["model.layers.60.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (
        (5, 56), "F32"
    )  # fmt: skip
    assert by_name["model.layers.60.self_attn.q_b_proj.weight"] == ((24576, 1536), "F8_E4M3")
    assert by_name["model.layers.60.self_attn.kv_b_proj.weight"] == ((32768, 512), "F8_E4M3")
    assert by_name["model.layers.60.self_attn.o_proj.weight"] == ((7168, 16384), "F8_E4M3")
    assert by_name["model.layers.61.mlp.experts.255.down_proj.weight"] == ((7168, 2048), "F8_E4M3")
    assert by_name["model.layers.61.eh_proj.weight"] == ((7168, 14336), "BF16")
    vocab = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.61.embed_tokens.weight"]
    for name in [*vocab, "model.layers.61.shared_head.head.weight"]:
        assert by_name[name] == ((129280, 7168), "BF16")
    config = DEEPSEEK_V3.config()
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }  # fmt: skip
    assert (config["num_hidden_layers"], config["first_k_dense_replace"]) == (61, 3)


def test_deepseek_v3_shards():
    shards = DEEPSEEK_V3.shards()
    assert len(shards) == 163 and all(shards)
    assert sorted(t for s in shards for t in s) == sorted(DEEPSEEK_V3.tensors())
    sizes = [sum(math.prod(shape) * ITEMSIZE[dtype] for _, shape, dtype in s) for s in shards]
    assert 3e9 < statistics.median(sizes) < 5e9
    names = [[name for name, _, _ in s] for s in shards]
    assert "model.embed_tokens.weight" in names[0]
    assert "model.layers.61.shared_head.head.weight" in names[-1]
    for s in shards:  # Hugging Face's order: element size descending, then name
        assert s == sorted(s, key=lambda t: (-ITEMSIZE[t[2]], t[0]))
    assert shard_name(7, 163) == "model-00007-of-000163.safetensors"


def test_sparse_checkpoint_of_mixed_dtypes_and_its_config(tmp_path):
    dims = DeepSeekDims(
        hidden=256, intermediate=384, moe_intermediate=64, layers=3, dense_layers=1,
        routed_experts=4, heads=2, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, vocab=300, shard_count=5,
    )  # fmt: skip
    write_sparse_checkpoint(tmp_path, dims.shards(), config=dims.config(), name=shard_name)
    ckpt = open_checkpoints([(str(tmp_path), "base")], Storage())[0]
    assert sorted(ckpt.files) == [shard_name(k, 5) for k in range(1, 6)]
    assert {n: (t.shape, t.dtype) for n, t in ckpt.tensors.items()} == {
        n: (shape, dtype) for n, shape, dtype in dims.tensors()
    }
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(str(tmp_path / shard_name(2, 5)), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("proj.weight"))
        assert f.get_slice(name).get_dtype() == "F8_E4M3"


def test_gpt_oss_120b_layout_is_transformers(tmp_path):
    """gpt-oss-120b's headers as published (687 tensors in 15 files from
    `model-00000-of-00014`, 65,248,815,744 bytes, the experts' weights MXFP4 pairs), and the
    bf16 agents': what the merge sees of the base (`Format.view`) and the agents' tensors are
    the names and shapes of transformers' `GptOssForCausalLM` of gpt-oss-120b's sizes."""
    transformers = pytest.importorskip("transformers")
    dims = gpt_oss.GPT_OSS_120B
    config = transformers.GptOssConfig(
        **{k: v for k, v in dims.config(mxfp4=False).items() if k != "architectures"}
    )
    assert (config.num_hidden_layers, config.num_local_experts, config.hidden_size) == (
        36, 128, 2880
    )  # fmt: skip
    assert (config.intermediate_size, config.num_attention_heads, config.head_dim) == (
        2880, 64, 64
    )  # fmt: skip
    assert (config.num_key_value_heads, config.vocab_size) == (8, 201088)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert dims.params == sum(math.prod(s) for s in expected.values()) == 116_829_156_672

    base, agent = tmp_path / "base", tmp_path / "agent"
    write_sparse_checkpoint(base, dims.shards(), config=dims.config(), name=gpt_oss.shard_name)
    write_sparse_checkpoint(agent, dims.shards(mxfp4=False), config=dims.config(mxfp4=False))
    ckpts = open_checkpoints([(str(base), "base"), (str(agent), "task")], Storage())
    stored = ckpts[0].tensors
    assert len(stored) == 687 and len(ckpts[0].files) == 15
    assert sorted(ckpts[0].files)[0] == "model-00000-of-00014.safetensors"
    assert sorted(ckpts[0].files)[-1] == "model-00014-of-00014.safetensors"
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 65_248_815_744  # the published index's
    assert index["weight_map"]["lm_head.weight"] == "model-00014-of-00014.safetensors"
    blocks = "model.layers.35.mlp.experts.gate_up_proj_blocks"
    assert (stored[blocks].dtype, stored[blocks].shape) == ("U8", (128, 5760, 90, 16))
    scales = stored["model.layers.0.mlp.experts.down_proj_scales"]
    assert (scales.dtype, scales.shape) == ("U8", (128, 2880, 90))
    assert {i.dtype for n, i in stored.items() if not n.endswith(("_blocks", "_scales"))} == {
        "BF16"
    }  # the sinks and the experts' biases included
    assert json.loads((base / "config.json").read_text())["quantization_config"] == (
        gpt_oss.QUANTIZATION_CONFIG
    )
    fmt = recognize(ckpts[0])
    assert len(fmt.mxfp4) == 72
    viewed = fmt.view(ckpts[0])
    assert {n: i.shape for n, i in viewed.items()} == expected
    assert {i.dtype for i in viewed.values()} == {"BF16"}
    assert {n: i.shape for n, i in ckpts[1].tensors.items()} == expected
    assert {i.dtype for i in ckpts[1].tensors.values()} == {"BF16"}
    assert recognize(ckpts[1]).mxfp4 == {}
    for s in dims.shards():  # Hugging Face's order: element size descending, then name
        assert s == sorted(s, key=lambda t: (-ITEMSIZE[t[2]], t[0]))
