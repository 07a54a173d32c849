"""Every method measures a task's update against the base at that task's precision (spec:
"Definitions", "The base at a task's precision"), end to end on a real local Ray.

Three sets of real tiny checkpoints, each with two agents that changed about 1 % (FP8) or
5 % (plain) of the elements and one agent saved unchanged from the base as its trainer
loaded it, in the agent's own dtype:

1. a fine-grained FP8 base (DeepSeek layout, `fp8_models`' shapes and blocks) with bf16
   agents, the unchanged one `(float32(q) * float32(scale)).to(bfloat16)` (plain tensors as
   they are), merged to FP8 (the default) and to bfloat16 (`out_dtype`);
2. a float32 base with bf16 agents (the unchanged one `base.to(bfloat16)`);
3. a bf16 base with fp16 agents (and a bf16 one), some base values fp16 subnormals (ties to
   even included), the unchanged one `base.to(float16)`.

Every method of the registry (as many tasks as it takes) runs on every set, on the fused
kernels with one row (an FP8 weight: one band) per unit or on the eager rule with whole
tensors, alternating along the registry and from one set to the next (every method meets
both paths, every set meets both over half the registry); the bytes must be those of the
independent references (`tests/support`, which never import ram_dist).
For the RAM family also: the unchanged agent changed 0 elements, and every element no agent
touched is the base's own bytes (a -0.0 included; an FP8 block no agent touched keeps the
base's bytes and scale).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import assert_same_bytes, load_checkpoint
from fp8_models import BLOCK, PLAIN, UNTOUCHED, WEIGHTS
from fp8_reference import FP8, SCALE, dequantize, quantize, requantize, write
from precision_sets import (
    PARAMETERS,
    RAM_FAMILY,
    TASK_WEIGHTS,
    WEIGHTED,
    InputSet,
    reference_for,
    tasks_for,
)

from ram_dist.api import run_merge
from ram_dist.methods.registry import METHODS
from ram_dist.planning.config import MergeConfig

pytestmark = pytest.mark.usefixtures("ray_local")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
#: The agents in task order: two that changed elements, then the one saved unchanged (so a
#: method of one or two tasks merges changed agents; the RAM family merges all three).
CHANGED, UNCHANGED = (0, 1), 2
#: Plain tensors of the float32 and bf16 sets: rows of 20, 24 rows in all.
SMALL = {
    "model.layers.0.mlp.down_proj.weight": (12, 20),
    "model.layers.0.self_attn.q_proj.weight": (6, 20),
    "model.norm.weight": (20,),
    "model.embed_tokens.weight": (5, 20),
}


def _agents(x_base: dict, dtypes, density: float, seed: int, scale: float, keep: dict):
    """Agents of `dtypes` from the base as loaded in each one's dtype: the first two change
    about `density` of the elements (the second also half of the first's), and each at least
    one element of every tensor (all task vectors of a tensor zero is multislerp's
    antipodal refusal, as mergekit's); the last changes none. `keep[name]` marks elements no
    agent changes; flat indices 6 and 7 the first agent changes where free. Returns (agents,
    touched)."""
    g = torch.Generator().manual_seed(seed)
    agents: list[dict] = [{}, {}, {}]
    touched = {}
    for name, x in x_base.items():
        free = ~keep[name]
        first = (torch.rand(x.shape, generator=g) < density) & free
        second = ((torch.rand(x.shape, generator=g) < density) | first) & free
        second &= (torch.rand(x.shape, generator=g) < 0.5) | ~first
        places = free.reshape(-1).nonzero().reshape(-1)
        first.reshape(-1)[places[len(places) // 3]] = True
        first.reshape(-1)[6:8] |= free.reshape(-1)[6:8]
        second.reshape(-1)[places[2 * len(places) // 3]] = True
        touched[name] = first | second
        for agent, mask, dtype in zip(agents, (first, second, None), dtypes, strict=True):
            loaded = x.to(dtype)  # the base as this agent's trainer loaded it
            if mask is None:
                agent[name] = loaded
                continue
            moved = loaded.float() + torch.randn(x.shape, generator=g) * scale
            agent[name] = torch.where(mask, moved.to(dtype), loaded)
    return agents, touched


def _save(root: Path, base: dict, agents: list[dict], block) -> tuple[Path, list[Path]]:
    write(base, root / "base", block)
    for i, agent in enumerate(agents):
        write(agent, root / f"agent{i}", None)
    return root / "base", [root / f"agent{i}" for i in range(len(agents))]


def _negative_zero(x: torch.Tensor, keep: dict, name: str) -> torch.Tensor:
    """x with a -0.0 at flat index 5 that no agent changes (`keep`)."""
    x.reshape(-1)[5] = -0.0
    keep[name] = torch.zeros(x.shape, dtype=torch.bool)
    keep[name].reshape(-1)[5] = True
    return x


def _fp8_set(root: Path) -> InputSet:
    """DeepSeek's layout: FP8 weights in 16 x 8 blocks (ragged), norm and embedding in bf16;
    a -0.0 in every tensor (e4m3fn's code 0x80 in the FP8 ones); blocks of `UNTOUCHED` that
    no agent changes."""
    g = torch.Generator().manual_seed(0)
    base, x_base, keep = {}, {}, {}
    for name, shape in WEIGHTS.items():
        x = _negative_zero(torch.randn(shape, generator=g) * 0.02, keep, name)
        base[name], base[name + SCALE] = quantize(x, BLOCK)
        x_base[name] = dequantize(base[name], base[name + SCALE], BLOCK)
        bm, bn = BLOCK
        for band, col in UNTOUCHED.get(name, []):
            keep[name][band * bm : (band + 1) * bm, col * bn : (col + 1) * bn] = True
    for name, shape in PLAIN.items():
        x = _negative_zero((torch.randn(shape, generator=g) * 0.1).to(BF16), keep, name)
        base[name] = x_base[name] = x
    agents, touched = _agents(x_base, (BF16, BF16, BF16), 0.01, 1, 0.01, keep)
    base_dir, task_dirs = _save(root, base, agents, BLOCK)
    row = max(s[-1] for s in {**WEIGHTS, **PLAIN}.values()) * 2
    return InputSet(base_dir, task_dirs, base, x_base, agents, touched, BLOCK, row)


def _plain_set(root: Path, base_dtype, dtypes, seed: int, epsilon: float = 1e-5) -> InputSet:
    g = torch.Generator().manual_seed(seed)
    base, keep = {}, {}
    for name, shape in SMALL.items():
        x = _negative_zero((torch.randn(shape, generator=g) * 0.02).to(base_dtype), keep, name)
        if base_dtype == BF16:
            # fp16 subnormals: 1/2 step (a tie, to 0), 3/2 steps (a tie, to 2), 5/4 (to 1).
            # The unchanged fp16 agent holds [0, 2**-23, 2**-24] there; the first agent
            # changes the first two, its tau measured from 0 and 2**-23, not from x_B.
            x.reshape(-1)[6:9] = torch.tensor([2.0**-25, 3 * 2.0**-25, 5 * 2.0**-26])
        base[name] = x
    agents, touched = _agents(base, dtypes, 0.05, seed + 1, 0.01, keep)
    base_dir, task_dirs = _save(root, base, agents, None)
    row = max(s[-1] for s in SMALL.values()) * max(x.element_size() for x in base.values())
    return InputSet(base_dir, task_dirs, base, base, agents, touched, None, row, None, epsilon)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, InputSet]:
    root = tmp_path_factory.mktemp("precision")
    fp8 = _fp8_set(root / "fp8")
    return {
        "fp8-base-bf16-agents": fp8,
        "fp8-base-bf16-agents-to-bf16": InputSet(**{**fp8.__dict__, "out_dtype": "bfloat16"}),
        "f32-base-bf16-agents": _plain_set(root / "f32", F32, (BF16, BF16, BF16), 10),
        # RAM's epsilon far below fp16's subnormal step, so that its counts see them
        "bf16-base-fp16-agents": _plain_set(root / "bf16", BF16, (F16, BF16, F16), 20, 2**-40),
    }


def _stored(merged: dict, s: InputSet) -> dict:
    """Merged float32 values as written: FP8 again where the base is (without out_dtype),
    else the output dtype (the base tensor's by default)."""
    out_dtype = getattr(torch, s.out_dtype) if s.out_dtype else None
    out = {}
    for name, y in merged.items():
        if s.base[name].dtype == FP8 and out_dtype is None:
            scale = s.base[name + SCALE]
            out[name], out[name + SCALE] = requantize(y, s.base[name], scale, s.block)
        else:
            out[name] = y.to(out_dtype or s.base[name].dtype)
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _assert_untouched_elements_are_the_base(got: dict, s: InputSet) -> None:
    """Where no agent changed anything: the base's bytes (an FP8 weight written as FP8: every
    block no agent touched keeps the base's codes and scale)."""
    out_dtype = getattr(torch, s.out_dtype) if s.out_dtype else None
    for name, x in s.x_base.items():
        if s.base[name].dtype == FP8 and out_dtype is None:
            bm, bn = BLOCK
            blocks = UNTOUCHED.get(name, [])
            for band, col in blocks:
                rows, cols = slice(band * bm, (band + 1) * bm), slice(col * bn, (col + 1) * bn)
                q, base_q = got[name].view(torch.uint8), s.base[name].view(torch.uint8)
                assert torch.equal(q[rows, cols], base_q[rows, cols]), (name, band, col)
                assert got[name + SCALE][band, col] == s.base[name + SCALE][band, col]
            continue
        want = x.to(out_dtype or x.dtype)
        free = ~s.touched[name]
        assert torch.equal(_bits(got[name])[free], _bits(want)[free]), name
        negative_zero = torch.signbit(want) & (want == 0) & free
        assert bool(negative_zero.any()) and bool(torch.signbit(got[name][negative_zero]).all())


#: Each set's paths: one row per unit on the fused kernels, or whole tensors on the eager
#: rule (`_path` picks one per method); the FP8 set written to bf16 at one row per unit,
#: eagerly.
SPLITS = {
    "fp8-base-bf16-agents": [("row", "auto"), ("whole", "eager")],
    "fp8-base-bf16-agents-to-bf16": [("row", "eager")],
    "f32-base-bf16-agents": [("row", "auto"), ("whole", "eager")],
    "bf16-base-fp16-agents": [("row", "auto"), ("whole", "eager")],
}


def _path(method: str, which: str) -> tuple[str, str]:
    """The (budget, kernels) `method` merges set `which` with: of a set's two paths, the one
    that alternates along the registry and from one set to the next, so that every method
    runs both and every set meets both over half the registry."""
    paths = SPLITS[which]
    both = [w for w, p in SPLITS.items() if len(p) == 2]
    if which not in both:
        return paths[0]
    return paths[(list(METHODS).index(method) + both.index(which)) % 2]


@pytest.mark.parametrize("which", list(SPLITS))
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_measures_tasks_at_their_precision(sets, tmp_path, method, which):
    s = sets[which]
    picked = tasks_for(method)
    merged, stats = reference_for(method, s, picked)
    expected = _stored(merged, s)
    per_task = tuple({"weight": TASK_WEIGHTS[i]} for i in range(len(picked)))
    parameters = PARAMETERS.get(method, {})
    if method in RAM_FAMILY:
        parameters = {"epsilon": s.epsilon}
    budget, kernels = _path(method, which)
    out = tmp_path / f"{budget}-{kernels}"
    report = run_merge(
        MergeConfig(
            base=str(s.base_dir), tasks=tuple(str(s.task_dirs[i]) for i in picked),
            out=str(out), method=method, parameters=parameters,
            task_parameters=per_task if method in WEIGHTED else (),
            unit_budget_bytes=s.row_budget if budget == "row" else 10**8,
            kernels=kernels, out_dtype=s.out_dtype,
        )
    ).data  # fmt: skip
    got = load_checkpoint(out)
    assert_same_bytes(got, expected)
    if kernels == "eager":
        assert report["passes"]["map"]["fused_elements"] == 0
    if method not in RAM_FAMILY:
        return
    tasks = report["tasks"]
    assert tasks[UNCHANGED]["changed"] == 0
    assert all(tasks[i]["changed"] > 0 for i in CHANGED)
    assert [t["histogram"] for t in tasks] == stats["H"]
    if "lambda_per_tensor" in stats:  # ramplus_tl: per tensor, from its own counts
        assert report["lambda_per_tensor"] == stats["lambda_per_tensor"]
    else:
        assert report["lambda_applied"] == stats["lambda32"]
    _assert_untouched_elements_are_the_base(got, s)
