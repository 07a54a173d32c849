"""Hand-checked tests of the oracle (tests/support/reference.py) and of the checkpoint builders.

Expected values are worked out by hand in the comments; powers of two keep them exact.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from builders import build_model_set, load_checkpoint, make_agents, make_task_state
from reference import base_at, reference_merge, reference_stats, task_value, task_vector

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def f32(x: float) -> float:
    """Round to float32 by hand (struct), independently of the oracle's own helper."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def t(values, dtype=F32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def vals(x: torch.Tensor) -> list[float]:
    return x.to(F64).reshape(-1).tolist()


# 6 elements, 3 tasks. c = [1, 2, 3, 1, 2, 0]; element 5 moves by 2**-18 < eps in task 3.
BASE = {"w": t([0.0, 1.0, 2.0, -1.0, 0.5, 4.0])}
TASKS = [
    {"w": t([0.25, 1.5, 2.5, -1.0, 0.5, 4.0])},
    {"w": t([0.0, 2.0, 3.0, -1.5, 0.75, 4.0])},
    {"w": t([0.0, 1.0, 2.75, -1.0, 1.0, 4.0 + 2**-18])},
]


def test_stats_hand_checked():
    s = reference_stats(BASE, TASKS)
    assert s["d"] == 6 and s["unchanged"] == 1
    assert s["H"] == [[1, 1, 1], [1, 2, 1], [0, 1, 1]]
    assert s["unique"] == [1, 1, 0] and s["shared"] == [2, 3, 2]
    assert s["density"] == [3 / 6, 4 / 6, 2 / 6]
    assert s["rho"] == [2.0, 3.0, math.inf]  # task 3 has no unique element


def test_ram_plus_exact_lambdas():
    # lambda = 1 + 0.5 * clip(rho, 0, 2.5) = [2, 2.25, 2.25 (rho inf -> alpha)]
    out, s = reference_merge(BASE, TASKS, "ram_plus", r=0.5, alpha=2.5)
    assert s["lambda64"] == [2.0, 2.25, 2.25] and s["lambda32"] == [2.0, 2.25, 2.25]
    # e0: 2*0.25; e1: 1+(0.5+1)/2; e2: 2+(0.5+1+0.75)/3; e3: -1+2.25*-0.5; e4: 0.5+0.75/2
    assert vals(out["w"]) == [0.5, 1.75, 2.75, -2.125, 0.875, 4.0]
    assert out["w"].dtype == F32


def test_ram_is_plain_mean_and_copy():
    out, s = reference_merge(BASE, TASKS, "ram")
    assert s["lambda64"] == [1.0, 1.0, 1.0] and s["lambda32"] == [1.0, 1.0, 1.0]
    assert vals(out["w"]) == [0.25, 1.75, 2.75, -1.5, 0.875, 4.0]


def test_ram_plus_defaults_lambda_rounded_to_float32():
    # rho = [2, 3, inf] -> clip to alpha = 2 -> 1 + 0.1*2 = 1.2 for all; float32(1.2) != 1.2.
    out, s = reference_merge(BASE, TASKS, "ram_plus")
    assert s["lambda64"] == [1.2, 1.2, 1.2]
    assert s["lambda32"] == [1.2000000476837158] * 3 == [f32(1.2)] * 3
    # e0 = f32(1.2) * 0.25 (exact); e3 = -1 - f32(1.2)/2 = -1.6000000238418579 (= f32(-1.6)).
    assert vals(out["w"]) == [0.30000001192092896, 1.75, 2.75, -1.6000000238418579, 0.875, 4.0]


def test_ram_plus_soft():
    # 1 + 0.1*rho/(1+rho): rho=2 -> 1+0.2/3, rho=3 -> 1.075, rho=inf -> 1 + r = 1.1.
    out, s = reference_merge(BASE, TASKS, "ram_plus_soft")
    assert s["lambda64"] == [1.0666666666666667, 1.075, 1.1]
    assert s["lambda32"] == [f32(1.0666666666666667), f32(1.075), f32(1.1)]
    assert s["lambda32"] == [1.0666667222976685, 1.0750000476837158, 1.100000023841858]
    # e0 = f32(f32(1.0666667) * 0.25) exact (power of two), e3 = f32(-1 - 1.075f/2).
    expected_e3 = f32(-1.0 - 1.0750000476837158 / 2)
    assert vals(out["w"]) == [1.0666667222976685 / 4, 1.75, 2.75, expected_e3, 0.875, 4.0]


def test_eps_is_strict_and_task_that_changed_nothing():
    eps = float(t(1e-5))  # 9.99999974737875e-06, exactly representable
    above = float(torch.nextafter(t(eps), t(1.0)))
    base = {"w": t([0.0, 0.0, 0.0, 0.0])}
    tasks = [{"w": t([eps, -eps, above, 0.0])}, {"w": t([0.0, 0.0, 0.0, 0.0])}]
    for e in (eps, 1e-5):  # default eps too: float32(1e-5) < 1e-5
        out, s = reference_merge(base, tasks, "ram_plus", eps=e)
        assert s["unchanged"] == 3 and s["H"] == [[1, 0], [0, 0]]
        assert s["rho"] == [0.0, 0.0] and s["lambda32"] == [1.0, 1.0]
        assert s["density"] == [0.25, 0.0]
        assert vals(out["w"]) == [0.0, 0.0, above, 0.0]
    _, soft = reference_merge(base, tasks, "ram_plus_soft", eps=eps)
    assert soft["lambda64"] == [1.0, 1.0]


def test_float64_input_makes_compute_float64():
    # Only task 1 is F64: tau = 1e-5 + 1e-12 > eps in float64 (it would vanish in float32).
    base = {"w": t([0.0, 0.0])}
    tasks = [{"w": t([1e-5 + 1e-12, 0.0], F64)}, {"w": t([0.0, 0.5])}]
    out, s = reference_merge(base, tasks, "ram", out_dtype=F64)
    assert s["H"] == [[1, 0], [1, 0]]
    assert vals(out["w"]) == [1e-5 + 1e-12, 0.5]
    out32, _ = reference_merge(base, tasks, "ram")  # default out dtype = base dtype
    assert out32["w"].dtype == F32 and vals(out32["w"]) == [f32(1e-5 + 1e-12), 0.5]


def test_c1_uses_float32_lambda_in_float64_compute():
    # rho = [1, 1]; authors' setting r=0.2, alpha=1 -> lambda 1.2 -> float32 1.2000000476837158.
    base = {"w": t([0.0, 1.0, 2.0, 3.0], F64)}
    tasks = [{"w": t([0.25, 1.0, 2.5, 3.0], F64)}, {"w": t([0.0, 1.5, 2.5, 3.0], F64)}]
    out, s = reference_merge(base, tasks, "ram_plus", r=0.2, alpha=1.0)
    assert s["rho"] == [1.0, 1.0] and s["lambda64"] == [1.2, 1.2]
    # 0.25 * 1.2000000476837158 = 0.30000001192092896, not 0.3; 1 + 0.6000000238418579.
    assert vals(out["w"]) == [0.30000001192092896, 1.6000000238418579, 2.5, 3.0]
    assert out["w"].dtype == F64


def test_mean_is_summed_in_task_order_then_divided_once():
    # ulp(1024) in float32 is 2**-13: 1024 + 2**-14 ties to even (1024), twice. So task order
    # [1024, 2**-14, 2**-14] sums to 1024, while [2**-14, 2**-14, 1024] sums to 1024 + 2**-13.
    base = {"w": t([0.0])}
    a, b = {"w": t([1024.0])}, {"w": t([2.0**-14])}
    out, _ = reference_merge(base, [a, b, b], "ram")
    assert vals(out["w"]) == [f32(1024 / 3)]
    out2, _ = reference_merge(base, [b, b, a], "ram")
    assert vals(out2["w"]) == [f32((1024 + 2**-13) / 3)] != [f32(1024 / 3)]


def test_integer_tensors_copied_and_not_counted():
    base = {"ids": t([1, 2, 3], torch.int64), "w": t([1.0])}
    tasks = [
        {"ids": t([4, 5, 6], torch.int64), "w": t([1.5])},
        {"ids": t([7, 8, 9], torch.int64), "w": t([2.0])},
    ]
    out, s = reference_merge(base, tasks, "ram_plus", out_dtype=torch.float16)
    assert out["ids"].dtype == torch.int64 and out["ids"].tolist() == [1, 2, 3]
    assert s["d"] == 1 and s["H"] == [[0, 1], [0, 1]]
    assert out["w"].dtype == torch.float16 and vals(out["w"]) == [1.75]


def test_0d_and_1d_tensors_share_global_stats():
    base = {"s": t(1.0), "v": t([1.0, 2.0])}
    tasks = [{"s": t(1.5), "v": t([1.0, 2.5])}, {"s": t(2.0), "v": t([1.5, 2.0])}]
    out, s = reference_merge(base, tasks, "ram_plus", r=0.5)
    # s: c=2 for both; v: one unique each -> H = [[1, 1], [1, 1]], rho 1, lambda 1.5.
    assert s["d"] == 3 and s["H"] == [[1, 1], [1, 1]] and s["lambda32"] == [1.5, 1.5]
    assert out["s"].shape == () and out["s"].item() == 1.75  # 1 + (0.5 + 1) / 2
    assert vals(out["v"]) == [1.75, 2.75]  # 1 + 1.5*0.5, 2 + 1.5*0.5


def test_bf16_output_round_to_nearest_even_and_negative_zero():
    u = 2.0**-7  # bf16 spacing in [1, 2); 2**-6 in [2, 4)
    base = {"w": t([1.0, 1.0, 1.0, -0.0, 2.0], BF16)}
    tasks = [
        {"w": t([1 + 2 * u, 1 + u, 1 + u, -0.0, 2.0], BF16)},
        {"w": t([1 - u, 1 + 2 * u, 1.0, 0.0, 2 + 2 * u], BF16)},
    ]
    out, s = reference_merge(base, tasks, "ram_plus")
    # rho = [2/1, 2/1] -> lambda 1.2 -> float32 1.2000000476837158.
    assert s["H"] == [[1, 2], [1, 2]] and s["lambda32"] == [f32(1.2)] * 2
    w = out["w"]
    assert w.dtype == BF16
    # e0: 1 + 2**-8 ties -> 1.0 (even); e1: 1 + 1.5u ties -> 1 + 2u (even);
    # e2: 1 + 1.2u -> 1 + u; e4: 2 + 1.2*2u -> 2 + 2u; e3: c=0 keeps -0.0.
    assert vals(w) == [1.0, 1 + 2 * u, 1 + u, 0.0, 2 + 2 * u]
    assert torch.signbit(w[3]).item()
    out32, _ = reference_merge(base, tasks, "ram_plus", out_dtype=F32)
    lam = f32(1.2)
    assert vals(out32["w"]) == [1 + u / 2, 1 + 1.5 * u, f32(1 + lam * u), 0.0, f32(2 + lam * 2 * u)]
    assert torch.signbit(out32["w"][3]).item()


def test_ramplus_tl_lambda_per_tensor():
    # One tensor: its counts are the model's, unique [1, 1, 0], shared [2, 3, 2]. mergekit's
    # rho = shared / max(unique, eps) = [2, 3, 2e5], clipped to alpha = 0.2 (its default):
    # lambda = 1 + 0.1 * 0.2 in float32 for every task.
    out, s = reference_merge(BASE, TASKS, "ramplus_tl")
    lam = f32(1 + f32(f32(0.1) * f32(0.2)))
    assert s["lambda_per_tensor"] == {"w": [lam, lam, lam]} and lam == 1.0199999809265137
    # e0 = lam * 0.25 (exact); e3 = -1 + f32(lam * -0.5) (exact: lam/2 is a float32).
    assert vals(out["w"]) == [lam / 4, 1.75, 2.75, f32(-1 - lam / 2), 0.875, 4.0]


# ---- the base at a task's precision (spec: "Definitions", first bullet) ------------------
# bf16 keeps 8 significant bits: its spacing in [1, 2) is u = 2**-7; fp16's smallest
# subnormal is 2**-24 and its largest finite value 65504.


def test_base_at_rounds_to_nearest_even_only_where_the_task_narrows():
    u = 2.0**-7
    x = t([1 + u / 2, 1 + 3 * u / 2, 1 + u / 2 + 2**-20, -0.0, 0.1])  # F32 base values
    # Ties go to the even neighbour: 1 + u/2 -> 1.0, 1 + 3u/2 -> 1 + 2u; past a tie, up.
    assert vals(base_at(x, BF16)) == [1.0, 1 + 2 * u, 1 + u, 0.0, 0.10009765625]
    assert base_at(x, BF16).dtype == BF16 and torch.signbit(base_at(x, BF16)[3]).item()
    assert base_at(x, t([0.0], BF16)).dtype == BF16  # a task tensor or its dtype
    # The identity: F32 and F64 tasks, a decoded (float32) task, the base's own dtype.
    for dtype in (F32, F64):
        assert base_at(x, dtype) is x
    xb = x.to(BF16)
    assert base_at(xb, BF16) is xb
    # A bf16 base and an fp16 task: bf16's range is wider, so fp16 rounds its subnormals
    # (2**-25 is half of fp16's smallest step: a tie, to the even 0; 3 * 2**-25 is 1.5 steps:
    # to 2 steps) and refuses what overflows it (65536 > 65504).
    small = t([2.0**-25, 3 * 2.0**-25, 5 * 2.0**-26, 1 + u], BF16)
    assert vals(base_at(small, F16)) == [0.0, 2.0**-23, 2.0**-24, 1 + u]
    with pytest.raises(ValueError, match="overflows"):
        base_at(t([65536.0], BF16), F16)
    assert vals(base_at(t([math.inf], BF16), F16)) == [math.inf]  # not finite: no refusal
    # float32's largest finite value rounds up to bf16's infinity: refused as well.
    with pytest.raises(ValueError, match="overflows"):
        base_at(t([torch.finfo(F32).max]), BF16)


def test_task_vector_and_value_against_the_base_at_the_task_precision():
    u = 2.0**-7
    x = t([1 + u / 2, 1 + u / 2, 3.0])  # F32 base
    task = t([1.0, 1 + u, 3.0], BF16)  # unchanged, one step up, unchanged
    assert vals(task_vector(x, task)) == [0.0, u, 0.0]  # against bf16(x) = [1, 1, 3]
    assert task_vector(x, task, F64).dtype == F64
    # A value-blending method's view: x_B + tau, so an untouched element is x_B itself.
    assert vals(task_value(x, task)) == [1 + u / 2, 1 + 3 * u / 2, 3.0]
    # An F32 task of the same base is measured against x_B, and is its own value.
    plain = t([1.0, 1 + u, 3.0])
    assert vals(task_vector(x, plain)) == [-u / 2, u / 2, 0.0]
    assert vals(task_value(x, plain)) == vals(plain)


def test_float32_base_unchanged_bf16_agent_changes_nothing():
    """An F32 base, an agent saved unchanged in bf16 (`base.to(bf16)`), an F32 agent and a
    bf16 agent that each change one element. Measured against x_B itself, the unchanged
    agent would count 3 changes (e0, e1: u/2 each; e4: bf16(0.1) - 0.1 = 9.8e-5 > eps)."""
    u = 2.0**-7
    base = {"w": t([1 + u / 2, 1 + 3 * u / 2, -0.0, 3.0, 0.1])}
    unchanged = {"w": base["w"].to(BF16)}  # [1, 1 + 2u, -0, 3, 0.10009765625]
    plain = {"w": t([1 + u / 2, 1 + 3 * u / 2, -0.0, 3.5, 0.1])}  # e3 += 0.5
    agent = {"w": t([1 + u, 1 + 2 * u, -0.0, 3.0, 0.10009765625], BF16)}  # e0: bf16(x)+u
    out, s = reference_merge(base, [unchanged, plain, agent], "ram_plus")
    assert s["H"] == [[0, 0, 0], [1, 0, 0], [1, 0, 0]] and s["unchanged"] == 3
    assert s["rho"] == [0.0, 0.0, 0.0] and s["lambda32"] == [1.0, 1.0, 1.0]
    # e0: x_B + tau = (1 + u/2) + u; e1, e2, e4: c = 0, x_B itself (not bf16(x_B)), -0.0 kept.
    assert vals(out["w"]) == [1 + 3 * u / 2, 1 + 3 * u / 2, 0.0, 3.5, f32(0.1)]
    assert out["w"].dtype == F32 and torch.signbit(out["w"][2]).item()
    # Its float32 copy is measured against x_B itself: the rounding alone counts 3 changes.
    old = reference_stats(base, [{"w": unchanged["w"].float()}, plain, agent])
    assert sum(old["H"][0]) == 3


def test_bfloat16_base_float16_agent_subnormals_and_ties_to_even():
    """A bf16 base of values that are fp16 subnormals, an fp16 agent saved unchanged
    (`base.to(fp16)`) and one that changed two elements, eps 0 so that every rounding
    would count: the unchanged agent changed nothing."""
    step = 2.0**-24  # fp16's smallest subnormal
    base = {"w": t([step / 2, 3 * step / 2, 1.0, 0.5], BF16)}
    unchanged = {"w": base["w"].to(F16)}  # [0 (a tie, to even), 2 * step, 1, 0.5]
    assert vals(unchanged["w"]) == [0.0, 2 * step, 1.0, 0.5]
    agent = {"w": t([0.0, 4 * step, 1.0, 0.5 + 2**-11], F16)}  # e1: +2 steps, e3: +2**-11
    out, s = reference_merge(base, [unchanged, agent], "ram", eps=0.0)
    assert s["H"] == [[0, 0], [2, 0]] and s["unchanged"] == 2
    # e1: x_B + tau = 1.5 * step + 2 * step = 3.5 * step (= 7 * 2**-25, a bf16 value);
    # e3: 0.5 + 2**-11 rounds back to 0.5 in bf16 (spacing 2**-8 there); e0 stays x_B.
    assert out["w"].dtype == BF16
    assert vals(out["w"]) == [step / 2, 3.5 * step, 1.0, 0.5]
    # Against x_B itself, both agents would have changed e0 and e1 by the rounding alone.
    old = reference_stats(base, [{"w": x["w"].float()} for x in (unchanged, agent)], eps=0.0)
    assert old["H"] == [[0, 2], [1, 2]]
    with pytest.raises(ValueError, match="overflows"):
        reference_merge({"w": t([65536.0], BF16)}, [{"w": t([1.0], F16)}] * 2, "ram")


def test_value_blending_references_give_the_base_for_an_unchanged_agent():
    """Every reference that blends task values (or task vectors) returns the F32 base
    exactly for agents saved unchanged in bf16: nothing is merged from the rounding."""
    import geometric_reference as geo
    import sparse_reference as sparse
    import stock_reference as stock

    g = torch.Generator().manual_seed(11)
    base = torch.randn(4, 8, generator=g)
    same = base.to(BF16)

    def same_bits(got) -> bool:
        got = torch.as_tensor(got)
        return torch.equal(got.view(torch.int32), base.view(torch.int32))

    assert same_bits(stock.nearswap(base, same, 0.01))
    assert same_bits(stock.arcee_fusion(base, same))
    assert same_bits(stock.model_stock(base, [same, same]))
    assert same_bits(stock.model_stock(base, [same, same], filter_wise=True))
    assert same_bits(stock.sce(base, [same, same], 0.5))
    assert same_bits(geo.multislerp(base, [same], [1.0]))
    assert same_bits(geo.multislerp(base, [same, same], [1.0, 1.0]))
    for method in sparse.METHODS:
        merged = sparse.sparse_merge(method, base, [same, same], name="w", weights=[1.0, 1.0],
                                     densities=[1.0, 1.0])  # fmt: skip
        assert same_bits(merged), method
    # One element changed by one bf16 step: the value-blending view is x_B + that step.
    moved = same.clone()
    moved[0, 0] = (same[0, 0].float() * (1 + 2**-7)).to(BF16)
    step = moved[0, 0].float() - same[0, 0].float()
    assert stock.nearswap(base, moved, 1.0)[0, 0] == base[0, 0] + step
    assert geo.multislerp(base, [moved], [1.0])[0, 0] == base[0, 0] + step


def test_mismatched_checkpoints_raise():
    with pytest.raises(ValueError, match="missing"):
        reference_merge(BASE, [TASKS[0], {"x": t([1.0])}], "ram")
    with pytest.raises(ValueError, match="shape"):
        reference_merge(BASE, [TASKS[0], {"w": t([1.0])}], "ram")
    with pytest.raises(ValueError, match="method"):
        reference_merge(BASE, TASKS, "ties")


def test_make_task_state_mask_and_determinism():
    base = {"w": torch.linspace(-1, 1, 64).to(BF16), "ids": torch.arange(4)}
    mask = {"w": torch.arange(64) % 4 == 0}
    a = make_task_state(base, 0.5, seed=7, mask=mask)
    assert torch.equal(a["w"], make_task_state(base, 0.5, seed=7, mask=mask)["w"])
    assert torch.equal(a["ids"], base["ids"])
    assert torch.equal(a["w"] != base["w"], mask["w"])  # bounded noise survives bf16
    b = make_task_state(base, 0.5, seed=8, dtype=F32)
    assert b["w"].dtype == F32 and not torch.equal(b["w"].to(BF16), a["w"])


def test_tiny_model_set_densities_overlaps_and_files(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    densities = (0.03, 0.46, 0.54)
    base_dir, task_dirs, base, tasks = build_model_set(
        tmp_path,
        "llama",
        BF16,
        [None, F32, torch.float16],
        densities,
        base_shard="100KB",
        task_shard=60_000,
    )
    assert len(list(base_dir.glob("model-*-of-*.safetensors"))) > 1
    for i, d in enumerate(task_dirs):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(base)
        assert index["metadata"]["total_size"] == sum(
            x.numel() * x.element_size() for x in tasks[i].values()
        )
        assert (d / "config.json").read_bytes() == (base_dir / "config.json").read_bytes()
        assert (d / "tokenizer.json").exists() and (d / "chat_template.jinja").exists()
        loaded = load_checkpoint(d)
        assert all(torch.equal(loaded[k], tasks[i][k]) for k in base)
    assert [task["lm_head.weight"].dtype for task in tasks] == [BF16, F32, torch.float16]
    s = reference_stats(base, tasks)
    assert all(abs(got - want) < 0.01 for got, want in zip(s["density"], densities, strict=True))
    n_by_c = [sum(s["H"][i][k - 1] for i in range(3)) // k for k in (1, 2, 3)]
    assert all(n > 0 for n in n_by_c) and s["unchanged"] > 0
    assert s["unchanged"] + sum(n_by_c) == s["d"]
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    assert set(model.state_dict()) == set(base)
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())
    tok = PreTrainedTokenizerFast.from_pretrained(base_dir)
    assert tok("w3 w4")["input_ids"] == [7, 8]
    again = make_agents(base, densities, seed=1, dtypes=[None, F32, torch.float16])
    assert all(torch.equal(again[i][k], tasks[i][k]) for i in range(3) for k in base)


def test_tiny_qwen2_single_file(tmp_path):
    base_dir, task_dirs, base, tasks = build_model_set(tmp_path, "qwen2", F32)
    assert (base_dir / "model.safetensors").exists()
    assert (task_dirs[0] / "model.safetensors").exists()
    assert "model.layers.0.self_attn.q_proj.bias" in base
    assert all(v.dtype == F32 for v in tasks[1].values())
