"""Agents as RL trainers save them, each measured against the base at its own precision
(issue 41; spec "The base at a task's precision"), end to end on a real local Ray.

Every agent here is made by the real clients: `transformers` loads the base the way a trainer
does (an FP8 base in bf16, which on a CPU-only machine transformers dequantizes itself as
`(float32(q) * float32(scale)).to(bfloat16)`; an F32 base cast with `model.to(bfloat16)`),
a few known elements are moved, and `save_pretrained` writes the agent; a LoRA adapter is
trained one step by PEFT on the bf16-loaded FP8 base and saved by PEFT.

The expected counts and bytes come from the spec's rule written out below
(`theta_B^t = cast(x_B, p_t)`, `tau_t = float32(theta_t) - float32(theta_B^t)`, RAM's
statistics and merge, the output built on `x_B`), on whole tensors, never from ram_dist.
The FP8 block arithmetic (`fp8_reference`) and a LoRA adapter's delta (`lora_reference`)
are the test-side helpers, which do not import ram_dist either.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, build_tiny_base, load_checkpoint
from fp8_models import quantize_checkpoint
from fp8_reference import FP8, SCALE, dequantize, requantize, values
from lora_reference import adapter_deltas

from ram_dist import api

pytestmark = pytest.mark.usefixtures("ray_local")

#: transformers' FP8 dequantization needs blocks that divide every weight (the tiny model's
#: are 32 to 128 by 64 to 128), so 16 x 16 rather than DeepSeek's 128 x 128.
BLOCK = (16, 16)
EPS = 1e-5
SIXTEEN_BITS = (torch.bfloat16, torch.float16)
#: Share of each tensor's elements an agent moves, and the smallest move (several bf16 ulps
#: of every value here: weights of at most ~0.5, norms near 1, whose bf16 ulp is 2**-7).
SHARE = 0.01
STEP = 0.03

State = dict[str, torch.Tensor]


# --- The spec's rule, on whole tensors ----------------------------------------------------


def base_at(x_b: torch.Tensor, p: torch.dtype) -> torch.Tensor:
    """theta_B^t = cast(x_B, p_t), round to nearest even; the identity when p_t is F32, F64
    or decoded (an FP8 task's values are float32 here)."""
    return x_b.to(p) if p in SIXTEEN_BITS else x_b


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def task_vector(x_b: torch.Tensor, theta: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """tau_t = float32(theta_t) - float32(theta_B^t) (float64 if any input is F64)."""
    return theta.to(cdt) - base_at(x_b, theta.dtype).to(cdt)


def changed_mask(x_b: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """m_t = |tau_t| > eps, eps rounded to the compute dtype first."""
    cdt = compute_dtype(x_b, theta)
    return task_vector(x_b, theta, cdt).abs() > torch.tensor(EPS, dtype=cdt)


def spec_merge(
    base: State, tasks: list[State], method: str = "ram_plus", r: float = 0.1, alpha: float = 2.0
) -> tuple[State, dict]:
    """RAM / RAM+ on the inputs' values (FP8 weights decoded): the merged values `y` in the
    compute dtype, before the output's cast, and the global statistics."""
    n = len(tasks)
    hist = [[0] * n for _ in range(n)]  # hist[t][k - 1] = H[t][k]
    parts = {}
    for name, x_b in base.items():
        cdt = compute_dtype(x_b, *(t[name] for t in tasks))
        taus = [task_vector(x_b, t[name], cdt) for t in tasks]
        masks = [tau.abs() > torch.tensor(EPS, dtype=cdt) for tau in taus]
        c = sum(m.to(torch.int64) for m in masks)
        for t, m in enumerate(masks):
            counts = torch.bincount(c[m], minlength=n + 1)
            for k in range(1, n + 1):
                hist[t][k - 1] += int(counts[k])
        parts[name] = (cdt, taus, masks, c)
    unique = [row[0] for row in hist]
    shared = [sum(row[1:]) for row in hist]
    rho = [s / u if u else (math.inf if s else 0.0) for u, s in zip(unique, shared, strict=True)]
    if method == "ram":
        lam64 = [1.0] * n
    elif method == "ram_plus":
        lam64 = [1 + r * min(max(x, 0.0), alpha) for x in rho]
    else:
        raise ValueError(method)
    lam32 = [float(torch.tensor(x, dtype=torch.float32)) for x in lam64]
    merged: State = {}
    for name, x_b in base.items():
        cdt, taus, masks, c = parts[name]
        total = torch.zeros(x_b.shape, dtype=cdt)
        for tau, m in zip(taus, masks, strict=True):
            total = total + torch.where(m, tau, 0.0)  # task order, masked tasks add zeros
        delta = total / c.clamp(min=1).to(cdt)
        for t, (tau, m) in enumerate(zip(taus, masks, strict=True)):
            delta = torch.where(m & (c == 1), torch.tensor(lam32[t], dtype=cdt) * tau, delta)
        x = x_b.to(cdt)
        merged[name] = torch.where(c == 0, x, x + delta)  # built on x_B itself
    stats = {"H": hist, "unique": unique, "shared": shared, "lambda32": lam32}
    return merged, stats


def written(merged: State, base_stored: State, out_dtype: torch.dtype | None) -> State:
    """The output as stored: FP8 again (fresh scales, untouched blocks the base's bytes) for
    an FP8 base weight without out_dtype, else the values cast (RNE) to out_dtype or to the
    base tensor's dtype."""
    out: State = {}
    for name, y in merged.items():
        stored = base_stored[name]
        if stored.dtype == FP8 and out_dtype is None:
            out[name], out[name + SCALE] = requantize(y, stored, base_stored[name + SCALE], BLOCK)
        else:
            out[name] = y.to(out_dtype or stored.dtype)
    return out


def old_rule_changed(x_b: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """The rule before issue 41: measured against x_B itself (for the figures only)."""
    return (theta.double() - x_b.double()).abs() > EPS


def rounding_mask(x_b: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """A change whose value is exactly the base rounded to bfloat16 or float16 (where the base
    holds more than 16 bits)."""
    if x_b.dtype in SIXTEEN_BITS:
        return torch.zeros(x_b.shape, dtype=torch.bool)
    value = theta.float()
    return changed_mask(x_b, theta) & (
        (value == x_b.to(torch.bfloat16).float()) | (value == x_b.to(torch.float16).float())
    )


# --- Agents as trainers make them ---------------------------------------------------------


def trainer_load(folder: Path, dtype: torch.dtype, *then: torch.dtype):
    """The model as a trainer loads it with transformers (an FP8 checkpoint on a machine
    without FP8 kernels is dequantized by transformers itself), then cast with `.to(dtype)`
    for each of `then`."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    for d in then:
        model = model.to(d)
    return model


def choose_positions(base: State, seed: int, top_half_only: set[str]) -> tuple[dict, dict]:
    """Two agents' changed flat positions per tensor: k = max(1, round(1% of it)) each,
    overlapping in k - k // 2; in the tensors of `top_half_only`, drawn from their first half
    of rows only (the FP8 blocks below it no agent touches)."""
    g = torch.Generator().manual_seed(seed)
    first, second = {}, {}
    for name in sorted(base):
        t = base[name]
        rows = t.shape[0] // 2 if name in top_half_only else t.shape[0]
        allowed = rows * (t.numel() // t.shape[0])
        k = max(1, round(SHARE * t.numel()))
        perm = torch.randperm(allowed, generator=g)
        first[name], second[name] = perm[:k], perm[k // 2 : k // 2 + k]
    return first, second


def save_agent(model, folder: Path, positions: dict | None = None, seed: int = 0) -> State:
    """Move the elements at `positions` by +-(STEP to 2 STEP) in float32, stored in the
    parameter's dtype, as an optimizer step would; `save_pretrained`; return what was saved."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, pos in sorted((positions or {}).items()):
            p = params[name]
            flat = p.data.view(-1)
            sign = torch.where(torch.rand(len(pos), generator=g) < 0.5, -1.0, 1.0)
            move = sign * STEP * (1 + torch.rand(len(pos), generator=g))
            flat[pos] = (flat[pos].float() + move).to(p.dtype)
    model.save_pretrained(str(folder))
    return load_checkpoint(folder)


def changed_counts(report: dict) -> list[int]:
    return [sum(t["histogram"]) for t in report["tasks"]]


def expected_counts(first: dict, second: dict) -> tuple[int, int, int]:
    """(changed by each, unique to each, shared) of two agents' positions."""
    each = sum(len(p) for p in first.values())
    shared = sum(len(set(first[n].tolist()) & set(second[n].tolist())) for n in first)
    return each, each - shared, shared


def probe(base: Path, tasks: list[Path]) -> dict:
    return api.probe(base=base, tasks=tasks).data


def merge(base: Path, tasks: list[Path], out: Path, **kw) -> dict:
    return api.merge(base=base, tasks=tasks, out=out, **kw).as_dict()


def against(tasks: list[int], dtype: str, base: str, tensors: int) -> list[str]:
    """The report's `formats.measured_against` sentences for these tasks (1-based)."""
    return [
        f"task {t}: {dtype}, measured against the {base} base rounded to {dtype} ({tensors} "
        "tensors)"
        for t in tasks
    ]


# --- 1. A fine-grained FP8 base, bf16 agents ----------------------------------------------


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> dict:
    """A tiny Qwen2 made DeepSeek-style FP8 (every decoder weight in 16 x 16 blocks;
    embeddings, norms, biases, lm_head bf16); agents A (unchanged), B and C (1% each of every
    tensor, FP8 weights only in their top half of rows), loaded in bf16 by transformers and
    saved by save_pretrained."""
    root = tmp_path_factory.mktemp("fp8-trainer")
    build_tiny_base(root / "src", kind="qwen2", dtype=torch.bfloat16)
    stored = quantize_checkpoint(root / "src", root / "base", BLOCK)
    x_b = values(stored, BLOCK)
    fp8_weights = {n for n, t in stored.items() if t.dtype == FP8}
    first, second = choose_positions(x_b, seed=11, top_half_only=fp8_weights)
    agents = [
        save_agent(trainer_load(root / "base", torch.bfloat16), root / "A"),
        save_agent(trainer_load(root / "base", torch.bfloat16), root / "B", first, seed=1),
        save_agent(trainer_load(root / "base", torch.bfloat16), root / "C", second, seed=2),
    ]
    return {
        "root": root,
        "base_dir": root / "base",
        "stored": stored,
        "x_b": x_b,
        "fp8_weights": fp8_weights,
        "positions": (first, second),
        "task_dirs": [root / "A", root / "B", root / "C"],
        "agents": agents,
    }


def test_transformers_loads_the_fp8_base_in_bf16_as_the_spec_says(fp8):
    """What a trainer starts from: an unchanged agent saved by transformers holds, for every
    FP8 weight, `(float32(q) * float32(scale)).to(bfloat16)`, and the bf16 tensors as they
    are; its config has no quantization_config. And B and C differ from it exactly at their
    positions."""
    a = fp8["agents"][0]
    assert sorted(a) == sorted(fp8["x_b"])
    for name, x in fp8["x_b"].items():
        assert a[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name], x.to(torch.bfloat16)), name
    config = json.loads((fp8["task_dirs"][0] / "config.json").read_text())
    assert "quantization_config" not in config
    for agent, positions in zip(fp8["agents"][1:], fp8["positions"], strict=True):
        for name, pos in positions.items():
            moved = (agent[name] != a[name]).reshape(-1).nonzero().reshape(-1)
            assert torch.equal(moved, pos.sort().values), name


def test_probe_counts_only_the_trained_changes(fp8, tmp_path):
    """An agent saved unchanged from the FP8 base changed nothing; B and C changed exactly
    their positions, unique and shared as the positions overlap; the old rule would have
    counted most of A's FP8 weights as changed."""
    first, second = fp8["positions"]
    each, unique, shared = expected_counts(first, second)
    report = probe(fp8["base_dir"], fp8["task_dirs"])
    assert changed_counts(report) == [0, each, each]
    assert [t["histogram"] for t in report["tasks"]] == [
        [0, 0, 0],
        [unique, shared, 0],
        [unique, shared, 0],
    ]
    _, stats = spec_merge(fp8["x_b"], [values(s, BLOCK) for s in fp8["agents"]])
    assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    # The rule that changed: measured against x_B itself, A's untouched FP8 weights "change".
    x_b, a = fp8["x_b"], fp8["agents"][0]
    fp8_elements = sum(x_b[n].numel() for n in fp8["fp8_weights"])
    old = sum(int(old_rule_changed(x_b[n], a[n]).sum()) for n in fp8["fp8_weights"])
    assert old > 0.3 * fp8_elements, (old, fp8_elements)
    # Every FP8 weight of every task is measured against the base rounded to bf16; plan says
    # so before any work.
    sentences = against([1, 2, 3], "bfloat16", "FP8", len(fp8["fp8_weights"]))
    assert report["formats"]["measured_against"] == sentences
    planned = api.plan(base=fp8["base_dir"], tasks=fp8["task_dirs"], out=tmp_path / "plan")
    assert planned.data["formats"]["measured_against"] == sentences
    # The precision check (tensors whose base holds more than 16 bits: the FP8 weights) sees
    # the trained changes there and no rounding.
    in_fp8 = sum(len(first[n]) for n in fp8["fp8_weights"])
    precision = report["precision"]
    assert precision["tensors_checked"] == len(fp8["fp8_weights"])
    assert [(t["changed"], t["rounding"]) for t in precision["tasks"]] == [
        (0, 0),
        (in_fp8, 0),
        (in_fp8, 0),
    ]
    assert precision["warnings"] == []


@pytest.mark.parametrize("out_dtype", [None, "bfloat16"])
def test_merged_bytes_equal_the_spec_and_run_in_transformers(fp8, tmp_path, out_dtype):
    """RAM+ of A, B, C: the spec's bytes, FP8 again by default (the blocks below the agents'
    rows keep the base's bytes and scales) or bfloat16; the output loads in transformers and
    runs a forward pass, with the reference's weights."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    dtype = None if out_dtype is None else getattr(torch, out_dtype)
    report = merge(fp8["base_dir"], fp8["task_dirs"], out, out_dtype=out_dtype,
                   unit_budget_bytes=4096)  # fmt: skip
    merged, stats = spec_merge(fp8["x_b"], [values(s, BLOCK) for s in fp8["agents"]])
    expected = written(merged, fp8["stored"], dtype)
    got = load_checkpoint(out)
    assert_same_bytes(got, expected)
    assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    assert report["lambda_applied"] == stats["lambda32"]
    sentences = against([1, 2, 3], "bfloat16", "FP8", len(fp8["fp8_weights"]))
    assert report["formats"]["measured_against"] == sentences
    card = (out / "README.md").read_text()
    assert all(sentence in card for sentence in sentences)
    if out_dtype is None:
        bm = BLOCK[0]
        for name in fp8["fp8_weights"]:
            base_q, base_s = fp8["stored"][name], fp8["stored"][name + SCALE]
            half = base_q.shape[0] // 2  # a multiple of the block height here
            assert half % bm == 0
            q, s = got[name].view(torch.uint8), got[name + SCALE]
            assert torch.equal(q[half:], base_q.view(torch.uint8)[half:]), name
            assert torch.equal(s[half // bm :], base_s[half // bm :]), name
            assert not torch.equal(s[: half // bm], base_s[: half // bm]), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    state = model.state_dict()
    for name in merged:
        want = expected[name]
        if want.dtype == FP8:  # transformers dequantizes it on a CPU: (q * scale) in bf16
            want = dequantize(want, expected[name + SCALE], BLOCK).to(torch.bfloat16)
        assert torch.equal(state[name], want.to(torch.bfloat16)), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 42, 7]])).logits
    assert logits.shape == (1, 5, 256) and torch.isfinite(logits).all()


# --- 2. An F32 base with bf16 agents; a bf16 base with fp16 agents ------------------------


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> dict:
    """A tiny float32 Llama whose matrices are scaled by 5 (std about 0.1, so that a float16
    round trip moves most elements by more than eps), saved by transformers."""
    root = tmp_path_factory.mktemp("f32-trainer")
    build_tiny_base(root / "base", kind="llama", dtype=torch.float32)
    model = trainer_load(root / "base", torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(5.0)
    model.save_pretrained(str(root / "base"))
    x_b = load_checkpoint(root / "base")
    assert all(t.dtype == torch.float32 for t in x_b.values())
    return {"root": root, "base_dir": root / "base", "x_b": x_b}


def test_bf16_agents_of_an_f32_base(f32, tmp_path):
    """Agents loaded in float32, cast with `model.to(torch.bfloat16)` and saved: the unchanged
    one changed nothing, the other its positions; a float32 agent beside them; RAM+'s bytes
    are the spec's (float32 output, built on the base's float32 values)."""
    base_dir, x_b = f32["base_dir"], f32["x_b"]
    first, second = choose_positions(x_b, seed=21, top_half_only=set())
    states = [
        save_agent(trainer_load(base_dir, torch.float32, torch.bfloat16), tmp_path / "bf16-a"),
        save_agent(trainer_load(base_dir, torch.float32, torch.bfloat16), tmp_path / "bf16-b",
                   first, seed=3),
        save_agent(trainer_load(base_dir, torch.float32), tmp_path / "f32-c", second, seed=4),
    ]  # fmt: skip
    assert {t.dtype for t in states[0].values()} == {torch.bfloat16}
    tasks = [tmp_path / "bf16-a", tmp_path / "bf16-b", tmp_path / "f32-c"]
    each, unique, shared = expected_counts(first, second)
    report = probe(base_dir, tasks)
    assert changed_counts(report) == [0, each, each]
    assert report["tasks"][1]["histogram"] == [unique, shared, 0]
    old = sum(int(old_rule_changed(x_b[n], states[0][n]).sum()) for n in x_b)
    assert old > 0.5 * sum(t.numel() for t in x_b.values())  # what the old rule saw
    merged, stats = spec_merge(x_b, states)
    out = tmp_path / "out"
    merged_report = merge(base_dir, tasks, out, unit_budget_bytes=8192)
    assert_same_bytes(load_checkpoint(out), written(merged, x_b, None))
    assert [t["histogram"] for t in merged_report["tasks"]] == stats["H"]
    assert report["formats"]["measured_against"] == against([1, 2], "bfloat16", "float32", len(x_b))
    assert [t["rounding"] for t in report["precision"]["tasks"]] == [0, 0, 0]
    assert report["precision"]["warnings"] == []


def test_fp16_agents_of_a_bf16_base(tmp_path):
    """A bf16 base; agents loaded in bf16, cast with `model.to(torch.float16)` and saved: the
    unchanged one changed nothing, the changed one its positions; with a bf16 agent, RAM+'s
    bytes are the spec's (bf16 output)."""
    base_dir = tmp_path / "base"
    x_b = build_tiny_base(base_dir, kind="qwen2", dtype=torch.bfloat16, seed=3)
    first, second = choose_positions(x_b, seed=31, top_half_only=set())
    states = [
        save_agent(trainer_load(base_dir, torch.bfloat16, torch.float16), tmp_path / "fp16-a"),
        save_agent(trainer_load(base_dir, torch.bfloat16, torch.float16), tmp_path / "fp16-b",
                   first, seed=5),
        save_agent(trainer_load(base_dir, torch.bfloat16), tmp_path / "bf16-c", second, seed=6),
    ]  # fmt: skip
    assert {t.dtype for t in states[0].values()} == {torch.float16}
    # float16 holds every bf16 value of this base but the tiniest, whose rounding is below
    # eps: here the rule before issue 41 counted nothing either, and must still count nothing.
    assert sum(int(old_rule_changed(x_b[n], states[0][n]).sum()) for n in x_b) == 0
    tasks = [tmp_path / "fp16-a", tmp_path / "fp16-b", tmp_path / "bf16-c"]
    each, unique, shared = expected_counts(first, second)
    merged, stats = spec_merge(x_b, states)
    out = tmp_path / "out"
    report = merge(base_dir, tasks, out, unit_budget_bytes=8192)
    assert changed_counts(report) == [0, each, each]
    assert report["tasks"][1]["histogram"] == [unique, shared, 0]
    assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    assert_same_bytes(load_checkpoint(out), written(merged, x_b, None))
    assert changed_counts(probe(base_dir, tasks)) == [0, each, each]


# --- 3. A PEFT LoRA adapter trained on the bf16-loaded FP8 base ---------------------------


@pytest.fixture(scope="module")
def lora(fp8) -> dict:
    """One AdamW step (lr 1e-3) of a rank-4 LoRA on q, v and down_proj, PEFT on the FP8 base
    as transformers loads it in bf16, on random tokens; saved by PEFT. lora_B starts at zero,
    so after the step each delta is a few 1e-4: some survive bf16's rounding, some do not."""
    from peft import LoraConfig, get_peft_model

    folder = fp8["root"] / "lora"
    torch.manual_seed(0)
    model = trainer_load(fp8["base_dir"], torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                        lora_dropout=0.0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
        trained = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.0)
        ids = torch.randint(4, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        peft_model.save_pretrained(str(folder))
    return {"dir": folder}


def adapter_values(stored: State, x_b: State, adapter: Path) -> tuple[State, State]:
    """The adapter task's values by the spec (`theta_t = cast(float32(theta_B^t) + delta,
    p_t)`, p_t bfloat16 on a quantized base; an untouched tensor the base's value) and its
    float32 deltas."""
    deltas, starts, outright = adapter_deltas(stored, adapter)
    assert not starts and not outright and deltas
    task = dict(x_b)
    for name, delta in deltas.items():
        assert stored[name].dtype == FP8, name
        task[name] = (base_at(x_b[name], torch.bfloat16).float() + delta).to(torch.bfloat16)
    return task, deltas


def test_lora_deltas_that_round_away_are_unchanged(fp8, lora, tmp_path):
    """The adapter with agent B: the adapter changed exactly the elements whose delta
    survives bf16's rounding (fewer than its non-zero deltas); RAM+'s FP8 bytes and
    statistics are the spec's."""
    stored, x_b = fp8["stored"], fp8["x_b"]
    task, deltas = adapter_values(stored, x_b, lora["dir"])
    nonzero = sum(int((d != 0).sum()) for d in deltas.values())
    changed = sum(int(changed_mask(x_b[n], task[n]).sum()) for n in deltas)
    assert 0 < changed < nonzero  # some deltas round away, most do not
    tasks = [lora["dir"], fp8["task_dirs"][1]]
    report = probe(fp8["base_dir"], tasks)
    first, _ = fp8["positions"]
    assert changed_counts(report) == [changed, sum(len(p) for p in first.values())]
    merged, stats = spec_merge(x_b, [task, values(fp8["agents"][1], BLOCK)])
    assert [t["histogram"] for t in report["tasks"]] == stats["H"]
    rounding = sum(int(rounding_mask(x_b[n], task[n]).sum()) for n in deltas)
    assert [(t["changed"], t["rounding"]) for t in report["precision"]["tasks"][:1]] == [
        (changed, rounding)
    ]
    assert report["precision"]["warnings"] == []
    out = tmp_path / "out"
    merge(fp8["base_dir"], tasks, out, unit_budget_bytes=4096)
    assert_same_bytes(load_checkpoint(out), written(merged, stored, None))
    # The rule before issue 41 (bf16(x_B + delta) against x_B) counted far more.
    old = sum(
        int(old_rule_changed(x_b[n], (x_b[n] + d).to(torch.bfloat16)).sum())
        for n, d in deltas.items()
    )
    assert old > changed


# --- 4. The warning of an fp16 round trip -------------------------------------------------


def test_an_fp16_round_trip_is_warned_of(f32, tmp_path, capsys):
    """Task 1 went through float16 (`model.to(float16).to(float32)`), then 1% real changes,
    saved in float32: nearly all it changed is the base rounded to float16, and probe and
    merge warn of task 1 by name; task 2, a healthy float32 agent, has share 0 and no
    warning."""
    from ram_dist.cli import main

    base_dir, x_b = f32["base_dir"], f32["x_b"]
    first, second = choose_positions(x_b, seed=41, top_half_only=set())
    round_trip = trainer_load(base_dir, torch.float32, torch.float16, torch.float32)
    states = [
        save_agent(round_trip, tmp_path / "round-trip", first, seed=7),
        save_agent(trainer_load(base_dir, torch.float32), tmp_path / "healthy", second, seed=8),
    ]
    assert {t.dtype for t in states[0].values()} == {torch.float32}
    tasks = [tmp_path / "round-trip", tmp_path / "healthy"]
    changed = [sum(int(changed_mask(x_b[n], s[n]).sum()) for n in x_b) for s in states]
    rounding = [sum(int(rounding_mask(x_b[n], s[n]).sum()) for n in x_b) for s in states]
    report = probe(base_dir, tasks)
    assert changed_counts(report) == changed
    precision = report["precision"]
    assert precision["tensors_checked"] == len(x_b)
    assert [(t["task"], t["changed"], t["rounding"]) for t in precision["tasks"]] == [
        (1, changed[0], rounding[0]),
        (2, changed[1], 0),
    ]
    shares = [t["rounding_share"] for t in precision["tasks"]]
    assert shares[0] == rounding[0] / changed[0] and shares[0] > 0.9
    assert shares[1] == 0.0
    assert len(precision["warnings"]) == 1
    assert precision["warnings"][0].startswith("warning: task 1 ")
    assert "task 2" not in precision["warnings"][0]
    out = tmp_path / "out"
    argv = ["merge", "--base", str(base_dir), "--out", str(out)]
    assert main(argv + [a for t in tasks for a in ("--task", str(t))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning: task")] == precision["warnings"]
    saved = json.loads((out / "merge_report.json").read_text())
    assert saved["precision"] == precision
    argv = ["probe", "--base", str(base_dir)] + [a for t in tasks for a in ("--task", str(t))]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("warning: task")] == precision["warnings"]
