"""The LoRA reference (`lora_reference.py`) checked by hand on tiny tensors, and against
PEFT's own `merge_and_unload()` for every adapter form `peft_adapters.py` writes; and what
PEFT writes, as the engine relies on it."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from lora_reference import (
    AdapterRefused,
    adapter_deltas,
    adapter_task_state,
    fixed_order_product,
    get_pattern_key,
    load_state,
    materialize,
    module_scale,
)
from peft_adapters import (
    ADAPTER_FORMS,
    PREFIX,
    build_adapter,
    build_dora_adapter,
    build_loha_adapter,
    build_pickle_adapter,
    build_tiny_bases,
    merge_with_peft,
)
from safetensors.torch import load_file, save_file

F32 = torch.float32
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126}


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value of `x` rounded to `dtype` (float64; subnormal
    spacing below the smallest normal, the smallest spacing at 0)."""
    v = x.to(dtype).to(torch.float64).abs()
    _, e = torch.frexp(v)  # v = m * 2**e, m in [0.5, 1)
    e = torch.where(v == 0, torch.full_like(e, MIN_EXP[dtype] + 1), e) - 1
    return torch.exp2((e.clamp(min=MIN_EXP[dtype]) - MANTISSA[dtype]).to(torch.float64))


# ---------------------------------------------------------------------------------------
# (a) by hand
# ---------------------------------------------------------------------------------------


def test_product_sums_k_ascending_from_the_first_product():
    """1 + 2**-24 + 2**-24: k ascending gives 1 (each tie to even drops the half ulp); the
    other order, or an exact sum, gives 1 + 2**-23."""
    b = torch.tensor([[1.0, 1.0, 1.0]])
    a = torch.tensor([[1.0], [2.0**-24], [2.0**-24]])
    assert fixed_order_product(b, a).item() == 1.0
    assert fixed_order_product(b.flip(1), a.flip(0)).item() == 1.0 + 2.0**-23
    assert f32(1.0 + 2.0**-24 + 2.0**-24) == 1.0 + 2.0**-23  # float64 first: also differs


def test_product_rounds_each_product_no_fma():
    """(1 + 2**-12)^2 = 1 + 2**-11 + 2**-24 rounds (a tie, to even) to 1 + 2**-11, so with the
    k = 0 product -(1 + 2**-11) the sum is 0; a fused multiply-add keeps 2**-24."""
    x = 1.0 + 2.0**-12
    b = torch.tensor([[-(1.0 + 2.0**-11), x]])
    a = torch.tensor([[1.0], [x]])
    assert fixed_order_product(b, a).item() == 0.0
    fma = f32(-(1.0 + 2.0**-11) + x * x)  # the product exact in float64, one rounding
    assert fma == 2.0**-24


def test_product_is_elementwise_per_row_and_column():
    g = torch.Generator().manual_seed(1)
    b, a = torch.randn(5, 3, generator=g), torch.randn(3, 7, generator=g)
    p = fixed_order_product(b, a)
    for i in range(5):
        for j in range(7):
            acc = f32(b[i, 0].item() * a[0, j].item())
            for k in (1, 2):
                acc = f32(acc + f32(b[i, k].item() * a[k, j].item()))
            assert p[i, j].item() == acc
    # a bf16 factor is taken as its float32 value
    assert torch.equal(
        fixed_order_product(b.bfloat16(), a), fixed_order_product(b.bfloat16().float(), a)
    )


def test_scale_in_float64_then_float32_once():
    config = {"r": 3, "lora_alpha": 1}
    assert module_scale(config, "m")[2] == f32(1 / 3)
    config = {"r": 8, "lora_alpha": 16, "use_rslora": True}
    assert module_scale(config, "m")[2] == f32(16 / math.sqrt(8))
    # In float32 arithmetic sqrt(2) and the quotient would be rounded each: another float32.
    config = {"r": 2, "lora_alpha": 3, "use_rslora": True}
    assert module_scale(config, "m")[2] == f32(3 / math.sqrt(2)) == 2.1213202476501465
    assert f32(3 / f32(math.sqrt(2))) == 2.1213204860687256


def test_pattern_keys_match_as_peft_does():
    from peft.utils.other import get_pattern_key as peft_rule

    keys = ["layers.1.self_attn.q_proj", "v_proj", "q_proj"]
    names = [
        "model.layers.1.self_attn.q_proj",
        "model.layers.11.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.kq_proj",
        "model.layers.0.self_attn.q_proj",
        "q_proj",
    ]
    for name in names:
        assert get_pattern_key(keys, name) == peft_rule(keys, name)
    assert get_pattern_key(keys, "model.layers.1.self_attn.q_proj") == keys[0]  # first wins
    assert get_pattern_key(keys, "model.layers.11.self_attn.q_proj") == "q_proj"
    assert get_pattern_key(keys, "model.layers.0.self_attn.kq_proj") == names[3]  # no match
    config = {
        "r": 4,
        "lora_alpha": 8,
        "rank_pattern": {"v_proj": 2},
        "alpha_pattern": {"q_proj": 3},
    }
    assert module_scale(config, names[2]) == (2, 8, 4.0)
    assert module_scale(config, names[4]) == (4, 3, 0.75)


def _write_adapter(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    full = {"peft_type": "LORA", "r": 2, "lora_alpha": 3, **config}
    (folder / "adapter_config.json").write_text(json.dumps(full))
    save_file(
        {PREFIX + k: v for k, v in tensors.items()}, str(folder / "adapter_model.safetensors")
    )
    return folder


def test_task_state_by_hand(tmp_path):
    """Every rule of "The task's value" on tensors small enough to compute here."""
    g = torch.Generator().manual_seed(3)
    base = {
        "lin.weight": torch.randn(3, 4, generator=g).bfloat16(),
        "lin.bias": torch.randn(3, generator=g).half(),
        "emb.weight": torch.randn(5, 4, generator=g).bfloat16(),
        "head.weight": torch.randn(2, 4, generator=g).bfloat16(),
        "other.weight": torch.randn(4, generator=g).bfloat16(),
    }
    a, b = torch.randn(2, 4, generator=g), torch.randn(3, 2, generator=g)
    ea, eb = torch.randn(2, 5, generator=g), torch.randn(4, 2, generator=g)
    bias = torch.randn(3, generator=g)
    head = torch.randn(2, 4, generator=g).bfloat16()
    start = base["emb.weight"].clone()
    start[0, 0] = 1.0  # base_layer.weight is the value before the delta
    folder = _write_adapter(
        tmp_path / "a",
        {"modules_to_save": ["head"], "lora_bias": True},
        {
            "lin.lora_A.weight": a, "lin.lora_B.weight": b, "lin.lora_B.bias": bias,
            "emb.lora_embedding_A": ea, "emb.lora_embedding_B": eb,
            "emb.base_layer.weight": start, "head.weight": head,
        },
    )  # fmt: skip
    state = adapter_task_state(base, folder)
    s = f32(3 / 2)

    def expect(theta, bb, aa, transpose=False):
        out = torch.empty(bb.shape[0], aa.shape[1])
        for i in range(bb.shape[0]):
            for j in range(aa.shape[1]):
                acc = f32(bb[i, 0].item() * aa[0, j].item())
                acc = f32(acc + f32(bb[i, 1].item() * aa[1, j].item()))
                out[i, j] = f32(s * acc)
        out = out.T if transpose else out
        return (theta.float() + out).to(theta.dtype)

    assert torch.equal(state["lin.weight"], expect(base["lin.weight"], b, a))
    assert torch.equal(state["emb.weight"], expect(start, eb, ea, transpose=True))
    want_bias = torch.tensor(
        [f32(base["lin.bias"][i].item() + f32(s * bias[i].item())) for i in range(3)]
    )
    assert torch.equal(state["lin.bias"], want_bias.half())
    assert state["lin.bias"].dtype == torch.float16
    assert torch.equal(state["head.weight"], head)
    assert state["other.weight"] is base["other.weight"]
    # fan_in_fan_out: the delta transposed to W's [in, out] shape
    ffo = {"w.weight": torch.randn(4, 3, generator=g)}
    folder = _write_adapter(
        tmp_path / "ffo", {"fan_in_fan_out": True}, {"w.lora_A.weight": a, "w.lora_B.weight": b}
    )
    assert torch.equal(
        adapter_task_state(ffo, folder)["w.weight"], expect(ffo["w.weight"].T, b, a).T
    )


def test_task_state_on_an_fp8_base(tmp_path):
    """An FP8 weight: the adapter's precision is bf16, so theta_B^t is the dequantized value
    rounded to bf16 (the base as PEFT loads it) and theta_t = bf16(float32(theta_B^t) +
    delta) (its scale is gone); an FP8 weight the adapter does not touch keeps its bytes and
    scale."""
    from fp8_reference import dequantize, quantize

    g = torch.Generator().manual_seed(4)
    block = (2, 3)
    base = {}
    for name in ("w.weight", "u.weight"):
        base[name], base[name + "_scale_inv"] = quantize(torch.randn(5, 7, generator=g), block)
    a, b = torch.randn(2, 7, generator=g), torch.randn(5, 2, generator=g)
    folder = _write_adapter(tmp_path / "a", {}, {"w.lora_A.weight": a, "w.lora_B.weight": b})
    with pytest.raises(ValueError, match="block"):
        adapter_task_state(base, folder)
    state = adapter_task_state(base, folder, fp8_block=block)
    x_b = dequantize(base["w.weight"], base["w.weight_scale_inv"], block)
    theta_b = x_b.to(torch.bfloat16).float()  # the base at the adapter's precision
    delta = torch.tensor(f32(3 / 2)) * fixed_order_product(b, a)
    assert torch.equal(state["w.weight"], (theta_b + delta).to(torch.bfloat16))
    assert "w.weight_scale_inv" not in state
    assert state["u.weight"] is base["u.weight"]
    assert state["u.weight_scale_inv"] is base["u.weight_scale_inv"]


def test_fp8_base_adapter_starts_from_the_bf16_base_by_hand(tmp_path):
    """The rule change made visible on one element (bf16 spacing at 1 is u = 2**-7 = 16 *
    2**-11): x_B = q * s = 1 * (1 + 5 * 2**-10) = 1 + 10 * 2**-11, not a bf16 value; the
    adapter (r 2, alpha 3: s = 1.5) adds delta = 1.5 * -2**-10 = -3 * 2**-11.

    - theta_B^t = bf16(x_B) = 1 + u (10/16 of u is past the midpoint);
      theta_t = bf16((1 + 16 * 2**-11) - 3 * 2**-11) = bf16(1 + 13 * 2**-11) = 1 + u.
    - Measured from x_B itself (the old rule) it would be bf16(1 + 7 * 2**-11) = 1.0.

    A delta that rounds away leaves theta_B^t exactly (tau = 0): 2**-12 on a second element
    whose x_B = 1 + 2**-8 + 2**-12 (bf16: 1 + u, past the midpoint): bf16(1 + u + 2**-12) =
    1 + u, where the old rule gives bf16(1 + 2**-8 + 2**-11) = 1 + u as well. A third
    element of x_B = -0.0 gets the product's +0.0: -0.0 + 0.0 = +0.0 (IEEE), tau = 0."""
    from fp8_reference import FP8

    u = 2.0**-7
    q = torch.tensor([[1.0, 1.0, -0.0]]).to(FP8)
    scale = torch.tensor([[1 + 5 * 2**-10, 1 + 2**-8 + 2**-12, 1.0]])
    base = {"w.weight": q, "w.weight_scale_inv": scale}
    a = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # A [r=2, in=3]
    b = torch.tensor([[-(2.0**-10), 2.0**-12 / 1.5]])  # B [out=1, r=2]
    assert f32(1.5 * (2.0**-12 / 1.5)) == 2.0**-12
    folder = _write_adapter(tmp_path / "a", {}, {"w.lora_A.weight": a, "w.lora_B.weight": b})
    state = adapter_task_state(base, folder, fp8_block=(1, 1))
    got = state["w.weight"]
    assert got.dtype == torch.bfloat16
    assert got.float().tolist() == [[1 + u, 1 + u, 0.0]]
    assert not torch.signbit(got[0, 2]).item()
    x_b = q.float() * scale
    old_rule = (x_b + torch.tensor([[-3 * 2**-11, 2**-12, 0.0]])).to(torch.bfloat16)
    assert old_rule.float().tolist() == [[1.0, 1 + u, 0.0]]  # differs in the first element


def test_reference_refusals(tmp_path):
    base = {"lin.weight": torch.zeros(3, 4), "lin2.weight": torch.zeros(3, 4)}
    ok = {"lin.lora_A.weight": torch.ones(2, 4), "lin.lora_B.weight": torch.ones(3, 2)}
    cases = {
        "loha": ({"peft_type": "LOHA"}, ok),
        "dora": ({"use_dora": True}, ok),
        "no_tensor": (
            {},
            {"nope.lora_A.weight": torch.ones(2, 4), "nope.lora_B.weight": torch.ones(3, 2)},
        ),
        "shape": (
            {},
            {"lin.lora_A.weight": torch.ones(2, 5), "lin.lora_B.weight": torch.ones(3, 2)},
        ),
        "no_bias": ({"lora_bias": True}, {**ok, "lin.lora_B.bias": torch.ones(3)}),
        "stray_key": ({}, {**ok, "lin2.weight": torch.ones(3, 4)}),
    }
    for name, (config, tensors) in cases.items():
        folder = _write_adapter(tmp_path / name, config, tensors)
        with pytest.raises(AdapterRefused):
            adapter_task_state(base, folder)
    pickle_only = tmp_path / "bin"
    pickle_only.mkdir()
    (pickle_only / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (pickle_only / "adapter_model.bin").write_bytes(b"never opened")
    with pytest.raises(AdapterRefused, match="pickle"):
        adapter_task_state(base, pickle_only)


# ---------------------------------------------------------------------------------------
# (b), (c): against PEFT's merge_and_unload(), every form PEFT writes
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_bases(tmp_path_factory.mktemp("bases"))


def _compare_with_peft(base_dir: Path, adapter_dir: Path, merged_dir: Path) -> dict[str, int]:
    """Assert the spec's bound per element; return {tensor: elements that differ}."""
    base = load_state(base_dir)
    ours = adapter_task_state(base, adapter_dir)
    peft = load_state(merged_dir)
    deltas, _, _ = adapter_deltas(base, adapter_dir)
    assert ours.keys() == peft.keys()
    differ = {}
    for name, want in ours.items():
        got = peft[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if name not in deltas:  # untouched, base_layer.weight, modules_to_save: the same bytes
            assert torch.equal(got, want), name
            continue
        gap = (got.double() - want.double()).abs()
        bound = ulp(deltas[name], want.dtype) + ulp(want, want.dtype)
        assert bool((gap <= bound).all()), f"{name}: {float((gap / bound).max())} x the bound"
        differ[name] = int((gap != 0).sum())
        assert int((want != base[name]).sum()) > want.numel() // 4, f"{name} barely changed"
    return differ


@pytest.mark.parametrize("form", list(ADAPTER_FORMS))
def test_reference_agrees_with_peft_merge_and_unload(bases, tmp_path, form):
    kind, kwargs = ADAPTER_FORMS[form]
    adapter = build_adapter(bases[kind], tmp_path / "adapter", **kwargs)
    stored_dtype = kwargs.get("adapter_dtype", F32)
    # A float32 adapter merged as saved (PEFT's default autocast); a bf16 one in bf16 layers.
    merged = merge_with_peft(
        bases[kind], adapter, tmp_path / "merged", autocast_adapter_dtype=stored_dtype == F32
    )
    differ = _compare_with_peft(bases[kind], adapter, merged)
    total = sum(load_state(bases[kind])[n].numel() for n in differ)
    n_differ = sum(differ.values())
    print(f"{form}: {n_differ} of {total} elements differ from PEFT's merge")
    two_roundings = form in ("embedding", "bf16_adapter")
    if not two_roundings:
        # A float32 delta added in one rounding, as PEFT's Linear does: only the product's
        # order (a matrix multiply against k ascending) parts us, one ulp on a few elements.
        assert n_differ <= total // 1000
    else:
        assert n_differ > 0  # the delta rounded to bf16 first: many elements differ


def test_safe_merge_is_within_the_bound(bases, tmp_path):
    """`safe_merge=True` rounds a Linear's delta to the weight's dtype before adding."""
    adapter = build_adapter(bases["llama"], tmp_path / "a", r=8, lora_alpha=16)
    merged = merge_with_peft(bases["llama"], adapter, tmp_path / "m", safe_merge=True)
    assert sum(_compare_with_peft(bases["llama"], adapter, merged).values()) > 0


def test_materialized_task_loads_in_transformers(bases, tmp_path):
    """The reference's full checkpoint of a fan_in_fan_out (Conv1D) adapter: transformers
    loads it, and its logits are PEFT's merged model's (both bf16, within bf16 noise)."""
    from transformers import AutoModelForCausalLM

    kind, kwargs = ADAPTER_FORMS["fan_in_fan_out"]
    adapter = build_adapter(bases[kind], tmp_path / "adapter", **kwargs)
    state = materialize(bases[kind], adapter, tmp_path / "full")
    assert state.keys() == load_state(bases[kind]).keys()
    merged = merge_with_peft(bases[kind], adapter, tmp_path / "merged")
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=F32)(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(merged, dtype=F32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(bases[kind], dtype=F32)(ids).logits
    assert (ours - theirs).abs().max() < 0.05 * (ours - plain).abs().max()


# ---------------------------------------------------------------------------------------
# What PEFT 0.21 writes (the facts the engine relies on)
# ---------------------------------------------------------------------------------------


def _keys(folder: Path) -> set[str]:
    return set(load_file(str(folder / "adapter_model.safetensors")))


def test_what_peft_writes(bases, tmp_path):
    m0 = PREFIX + "model.layers.0."
    # an embedding: lora_embedding_A/B without ".weight", and the base embedding itself
    folder = build_adapter(bases["llama"], tmp_path / "emb", target_modules=("embed_tokens",))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    emb = PREFIX + "model.embed_tokens."
    assert set(tensors) == {
        emb + "lora_embedding_A",
        emb + "lora_embedding_B",
        emb + "base_layer.weight",
    }
    assert tensors[emb + "lora_embedding_A"].shape == (4, 256)
    assert tensors[emb + "lora_embedding_B"].shape == (64, 4)
    base = load_state(bases["llama"])
    assert torch.equal(tensors[emb + "base_layer.weight"], base["model.embed_tokens.weight"])
    # modules_to_save: plain keys; "norm" matches every *_layernorm by its ending
    folder = build_adapter(bases["llama"], tmp_path / "mts", target_modules=("q_proj",),
                           modules_to_save=("lm_head", "norm"))  # fmt: skip
    keys = _keys(folder)
    assert {PREFIX + "lm_head.weight", PREFIX + "model.norm.weight"} <= keys
    assert {m0 + "input_layernorm.weight", m0 + "post_attention_layernorm.weight"} <= keys
    assert not any("modules_to_save" in k for k in keys)
    # lora_bias on a layer without a bias (Qwen2's o_proj): saved all the same ...
    folder = build_adapter(
        bases["qwen2"], tmp_path / "nobias", target_modules=("o_proj",), lora_bias=True
    )
    assert m0 + "self_attn.o_proj.lora_B.bias" in _keys(folder)
    # ... and PEFT cannot merge it; the reference refuses it (no base tensor `o_proj.bias`)
    with pytest.raises(RuntimeError, match="base layer has no bias"):
        merge_with_peft(bases["qwen2"], folder, tmp_path / "nobias-merged")
    with pytest.raises(AdapterRefused, match="o_proj.bias"):
        adapter_task_state(load_state(bases["qwen2"]), folder)
    # a Conv1D target: PEFT sets fan_in_fan_out itself; factors are stored as for a Linear
    folder = build_adapter(bases["gpt2"], tmp_path / "ffo", target_modules=("c_attn",))
    assert json.loads((folder / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    attn = PREFIX + "transformer.h.0.attn.c_attn."
    assert tensors[attn + "lora_A.weight"].shape == (4, 64)
    assert tensors[attn + "lora_B.weight"].shape == (192, 4)
    assert load_state(bases["gpt2"])["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)


def test_refused_forms_as_peft_writes_them(bases, tmp_path):
    dora = build_dora_adapter(bases["llama"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    assert (config["peft_type"], config["use_dora"]) == ("LORA", True)
    assert any(k.endswith("lora_magnitude_vector") for k in _keys(dora))
    loha = build_loha_adapter(bases["llama"], tmp_path / "loha")
    assert json.loads((loha / "adapter_config.json").read_text())["peft_type"] == "LOHA"
    pickle_only = build_pickle_adapter(bases["llama"], tmp_path / "bin")
    assert (pickle_only / "adapter_model.bin").is_file()
    assert not (pickle_only / "adapter_model.safetensors").exists()
    base = load_state(bases["llama"])
    for folder in (dora, loha, pickle_only):
        with pytest.raises(AdapterRefused):
            adapter_task_state(base, folder)
