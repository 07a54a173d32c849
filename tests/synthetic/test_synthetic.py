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
from ram_dist.synthetic import gpt_oss, kimi
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


def _int4_modules(tensors) -> dict[str, tuple[int, ...]]:
    """The INT4 weights of `tensors`: module name to decoded shape (from `weight_packed`)."""
    return {
        n.removesuffix(".weight_packed"): (shape[0], shape[1] * kimi.PACK)
        for n, shape, _ in tensors
        if n.endswith(".weight_packed")
    }


def test_kimi_k2_thinking_layout():
    """Kimi-K2-Thinking as published: DeepSeek-V3's names at Kimi's sizes (61 layers, the
    first dense, 384 routed experts, 64 heads, vocabulary 163840), no MTP layer and no FP8;
    each routed expert's gate, up and down an INT4 triple (`weight_packed` I32 [out, in / 8],
    `weight_scale` BF16 [out, in / 32], `weight_shape` I32 [2], no zero point: symmetric), the
    rest BF16 but the routers' F32 correction biases. 1,026,408,232,448 parameters (the
    decoded elements): Kimi-K2's "1T total", 1,014,686,023,680 of them the 60 x 384 x 3
    routed experts' weights."""
    dims = kimi.KIMI_K2_THINKING
    tensors = dims.tensors()
    by_name = {name: (shape, dtype) for name, shape, dtype in tensors}
    assert len(tensors) == len(by_name) == 208_215
    int4 = _int4_modules(tensors)
    assert len(int4) == 60 * 384 * 3 == 69_120
    assert dims.params == 1_026_408_232_448
    assert 1.02e12 < dims.params < 1.04e12
    assert sum(math.prod(int4[m]) for m in int4) == 60 * 384 * 3 * 2048 * 7168
    base_bytes = sum(math.prod(shape) * ITEMSIZE[dtype] for _, shape, dtype in tensors)
    assert base_bytes == 594_205_904_896
    for module, (rows, cols) in int4.items():
        assert ".mlp.experts." in module
        assert by_name[module + ".weight_packed"] == ((rows, cols // 8), "I32")
        assert by_name[module + ".weight_scale"] == ((rows, cols // 32), "BF16")
        assert by_name[module + ".weight_shape"] == ((2,), "I32")
    x = "model.layers.60.mlp.experts.383."
    assert int4[x + "gate_proj"] == int4[x + "up_proj"] == (2048, 7168)
    assert int4[x + "down_proj"] == (7168, 2048)
    assert by_name[x + "gate_proj.weight_packed"] == ((2048, 896), "I32")
    assert by_name[x + "down_proj.weight_scale"] == ((7168, 64), "BF16")
    in_triples = {m + "." + s for m in int4 for s in kimi.INT4_SUFFIXES}
    assert {dtype for n, _, dtype in tensors if n not in in_triples} == {"BF16", "F32"}
    assert [n for n, _, dtype in tensors if dtype == "F32"] == [
        f"model.layers.{n}.mlp.gate.e_score_correction_bias" for n in range(1, 61)
    ]
    assert not any(n.endswith(("_scale_inv", "weight_zero_point")) for n in by_name)
    assert not any(n.startswith("model.layers.61.") for n in by_name)  # no MTP layer
    assert "model.layers.0.mlp.gate.weight" not in by_name  # the first layer is dense
    assert by_name["model.layers.0.mlp.down_proj.weight"] == ((7168, 18432), "BF16")
    assert by_name["model.layers.1.mlp.gate.weight"] == ((384, 7168), "BF16")
    assert by_name["model.layers.1.mlp.gate.e_score_correction_bias"] == ((384,), "F32")
    assert by_name["model.layers.1.mlp.shared_experts.down_proj.weight"] == ((7168, 2048), "BF16")
    a = "model.layers.60.self_attn."
    assert by_name[a + "q_a_proj.weight"] == ((1536, 7168), "BF16")
    assert by_name[a + "q_b_proj.weight"] == ((12288, 1536), "BF16")
    assert by_name[a + "kv_a_proj_with_mqa.weight"] == ((576, 7168), "BF16")
    assert by_name[a + "kv_b_proj.weight"] == ((16384, 512), "BF16")
    assert by_name[a + "o_proj.weight"] == ((7168, 8192), "BF16")
    for name in ["model.embed_tokens.weight", "lm_head.weight"]:
        assert by_name[name] == ((163840, 7168), "BF16")
    config = dims.config()
    assert config["quantization_config"] == kimi.QUANTIZATION_CONFIG
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert (config["num_hidden_layers"], config["first_k_dense_replace"]) == (61, 1)
    assert (config["n_routed_experts"], config["vocab_size"]) == (384, 163840)
    assert "quantization_config" not in dims.config(int4=False)


def test_kimi_k2_thinking_agent_is_the_base_decoded():
    """An agent's tensors are the base's, in the same order, with each INT4 triple replaced
    by the decoded BF16 `.weight` of `weight_shape`; 69,975 tensors, 2,052,816,510,976
    bytes."""
    dims = kimi.KIMI_K2_THINKING
    base, agent = dims.tensors(), dims.tensors(int4=False)
    int4 = _int4_modules(base)
    expected = []
    for name, shape, dtype in base:
        module, _, suffix = name.rpartition(".")
        if module in int4:
            if suffix == "weight_packed":
                expected.append((module + ".weight", int4[module], "BF16"))
        else:
            expected.append((name, shape, dtype))
    assert agent == expected
    assert len(agent) == 208_215 - 2 * 69_120 == 69_975
    assert sum(math.prod(s) * ITEMSIZE[d] for _, s, d in agent) == 2_052_816_510_976
    assert dims.params == sum(math.prod(s) for _, s, _ in agent)


def test_kimi_k2_thinking_files(tmp_path):
    """The base in 62 files `model-00001-of-000062.safetensors` ... of about equal bytes, with
    its `config.json`, read back by ram-dist as written; an agent in 412 of at most 5 GB as
    `save_pretrained` names them."""
    dims = kimi.KIMI_K2_THINKING
    shards = dims.shards()
    assert len(shards) == 62 and all(shards)
    assert sorted(t for s in shards for t in s) == sorted(dims.tensors())
    sizes = [sum(math.prod(shape) * ITEMSIZE[dtype] for _, shape, dtype in s) for s in shards]
    assert 9.4e9 < min(sizes) and max(sizes) < 9.8e9
    for s in shards:  # Hugging Face's order: element size descending, then name
        assert s == sorted(s, key=lambda t: (-ITEMSIZE[t[2]], t[0]))
    agent_shards = dims.shards(int4=False)
    assert len(agent_shards) == 412
    assert max(sum(math.prod(s) * ITEMSIZE[d] for _, s, d in f) for f in agent_shards) <= 5e9

    base, agent = tmp_path / "base", tmp_path / "agent"
    write_sparse_checkpoint(base, shards, config=dims.config(), name=shard_name)
    write_sparse_checkpoint(agent, agent_shards, config=dims.config(int4=False))
    ckpt = open_checkpoints([(str(base), "base")], Storage())[0]
    files = sorted(ckpt.files)
    assert files == [f"model-{k:05d}-of-000062.safetensors" for k in range(1, 63)]
    assert {n: (i.shape, i.dtype) for n, i in ckpt.tensors.items()} == {
        n: (shape, dtype) for n, shape, dtype in dims.tensors()
    }
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 594_205_904_896
    assert index["weight_map"]["model.embed_tokens.weight"] == files[0]
    assert index["weight_map"]["lm_head.weight"] == files[-1]
    assert json.loads((base / "config.json").read_text())["quantization_config"] == (
        kimi.QUANTIZATION_CONFIG
    )
    weight_map = json.loads((agent / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {
        n: f"model-{k:05d}-of-00412.safetensors"
        for k, s in enumerate(agent_shards, start=1)
        for n, _, _ in s
    }
    assert "quantization_config" not in json.loads((agent / "config.json").read_text())


def test_kimi_k2_thinking_is_what_transformers_and_compressed_tensors_make():
    """The agent's names and shapes are what `transformers` saves of a `DeepseekV3ForCausalLM`
    of Kimi's sizes (its experts fused in memory, saved one by one); the published
    `quantization_config` parses under `compressed-tensors`, quantizes exactly the routed
    experts (every other Linear is ignored by it) and packs each into our triple."""
    transformers = pytest.importorskip("transformers")
    ct_match = pytest.importorskip("compressed_tensors.utils.match")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.core_model_loading import revert_weight_conversion

    dims = kimi.KIMI_K2_THINKING
    skip = ("architectures", "model_type")
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in dims.config(int4=False).items() if k not in skip}
    )
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(config)
    saved = revert_weight_conversion(model, model.state_dict())
    assert {n: tuple(t.shape) for n, t in saved.items()} == {
        n: shape for n, shape, _ in dims.tensors(int4=False)
    }
    assert sum(t.numel() for t in saved.values()) == dims.params

    quantization = QuantizationConfig.model_validate(kimi.QUANTIZATION_CONFIG)
    base = dims.tensors()
    int4 = _int4_modules(base)
    linears = {
        n.removesuffix(".weight")
        for n, shape, _ in dims.tensors(int4=False)
        if len(shape) == 2 and not n.endswith(("embed_tokens.weight", "mlp.gate.weight"))
    }
    quantized = {
        m for m in linears if not any(ct_match.match_name(m, t) for t in quantization.ignore)
    }
    assert quantized == set(int4)
    scheme = quantization.config_groups["group_0"]
    assert PackedQuantizationCompressor.compression_param_names(scheme) == kimi.INT4_SUFFIXES
    by_name = {n: (shape, dtype) for n, shape, dtype in base}
    for module in (
        "model.layers.1.mlp.experts.0.up_proj",
        "model.layers.60.mlp.experts.383.down_proj",
    ):
        rows, cols = int4[module]
        scale = by_name[module + ".weight_scale"][0]
        packed = PackedQuantizationCompressor.compress(
            {
                "weight": torch.empty(rows, cols, dtype=torch.bfloat16, device="meta"),
                "weight_scale": torch.empty(scale, dtype=torch.bfloat16, device="meta"),
            },
            scheme,
        )
        assert tuple(packed["weight_packed"].shape) == by_name[module + ".weight_packed"][0]
        assert packed["weight_packed"].dtype == torch.int32
        assert packed["weight_shape"].tolist() == [rows, cols]
        assert scale == (rows, cols // scheme.weights.group_size)
