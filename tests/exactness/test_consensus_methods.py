"""mergekitty's `consensus_ta` and `consensus_ties` (TALL masks, Wang et al. 2024): a hand-checked
example; the rule on any split of a tensor (rounds over chunks, statistics summed, the state
through JSON, then the map pass) against the independent reference
(`support/tall_reference.py`); the whole engine on a real local Ray at one row per unit and
whole tensors, and from a mergekitty-shaped YAML config; refusals of bad parameters.

mergekit 0.1.5 has neither method, and mergekitty is not a test dependency: the reference was
checked against mergekitty's own `GTATask` (its git HEAD 6e04e19, float32) once, byte for
byte, with its L1 sums computed as it computes them (ram-dist's are exact sums, so with
`rescale` the factor may differ from mergekitty's by float32 rounding, as for TIES).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from builders import build_model_set, load_checkpoint
from chunked_rounds import run_chunked
from refusals import merge_refused
from tall_reference import consensus_merge

from ram_dist.api import run_merge
from ram_dist.methods import get_method
from ram_dist.planning.config import MergeConfig, load_yaml

W = [0.7, -0.35, 1.25]


def _params(method: str, **given) -> dict:
    """Every parameter the method is handed, its defaults where not given (3 tasks)."""
    m = get_method(method)
    out = {p.name: [p.default] * 3 if p.per_task else p.default for p in m.parameters if p.passed}
    out["weight"] = list(W)
    out.update(given)
    return out


def _run(method: str, base, tasks, bounds, params, name: str = "w") -> torch.Tensor:
    """The engine's rounds and map pass on chunks [bounds[i], bounds[i+1]) of flat indices,
    after the method's own check of the parameters."""
    get_method(method).check(params, name)
    return run_chunked(method, base, tasks, bounds, params, name)[0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _reference(method: str, base, tasks, params) -> torch.Tensor:
    return consensus_merge(
        method, base, tasks, weights=params["weight"], densities=params["density"],
        normalize=params["normalize"], rescale=params.get("rescale", False),
        k=params["k"][0], lambdas=params["lambda"],
    )  # fmt: skip


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize(("k", "want"), [(0, [2, 1, 1, 0.2]), (1, [2, 1, 1, 0.2]),
                                         (2, [2, 0, 0, 0.2]), (3, [0, 0, 0, 0])])  # fmt: skip
def test_an_element_is_kept_where_it_matters_to_k_tasks(k, want) -> None:
    """Three tasks on a zero base, lambda 0.5, weights 1: `mixed` = [2, 1, 1, 0.2]; task 1
    matters at elements 0, 1, 3 (1 > 0.5 * |2 - 1|, 1 > 0, 0.1 > 0.05), task 2 at 0 and 2,
    task 3 at 3 only: counts [2, 1, 1, 2]."""
    base = torch.zeros(4)
    tasks = [torch.tensor(t) for t in ([1, 1, 0, 0.1], [1, 0, 1, 0], [0, 0, 0, 0.1])]
    params = _params("consensus_ta", weight=[1.0] * 3, k=[k] * 3, **{"lambda": [0.5] * 3})
    got = _run("consensus_ta", base, tasks, [0, 4], params)
    assert _same(got, torch.tensor(want, dtype=torch.float32))
    assert _same(_reference("consensus_ta", base, tasks, params), got)


def _inputs(shape, seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    changed = [torch.rand(shape, generator=gen) < 0.6 for _ in range(3)]
    tasks = [base + 0.01 * torch.randn(shape, generator=gen) * c for c in changed]
    return base, tasks


CASES = [
    ("consensus_ta", {}),  # mergekitty's defaults: k 1, lambda 1, no normalize
    ("consensus_ta", {"k": [2] * 3, "lambda": [0.4, 0.2, 0.6], "normalize": True}),
    ("consensus_ta", {"k": [3] * 3, "lambda": [0.3] * 3, "weight": [1.0, 1.0, 1.0]}),
    ("consensus_ties", {}),  # density 1: TIES's sign election alone, then the masks
    ("consensus_ties", {"density": [0.3, 0.7, 1.0], "k": [2] * 3, "lambda": [0.5] * 3}),
    ("consensus_ties", {"density": [0.3, 0.6, 0.5], "k": [1] * 3, "rescale": True}),
    (
        "consensus_ties",
        {
            "density": [0.2, 0.5, 0.9],
            "k": [2] * 3,
            "lambda": [0.2, 0.4, 0.8],
            "rescale": True,
            "normalize": False,
        },
    ),  # fmt: skip
]


@pytest.mark.parametrize(("method", "given"), CASES)
def test_any_split_is_the_reference(method, given) -> None:
    base, tasks = _inputs((40, 33), seed=len(CASES[0][0]) + len(given))
    params = _params(method, **given)
    want = _reference(method, base, tasks, params)
    assert not _same(want, base)  # the case merges something
    n = base.numel()
    for bounds in ([0, n], [0, 1, 2, 500, 501, n], [*range(0, n, 33), n]):
        assert _same(_run(method, base, tasks, bounds, params), want), bounds


def test_the_masks_drop_what_task_arithmetic_keeps() -> None:
    """k = 0 is task arithmetic (every count is >= 0); a higher k drops more."""
    base, tasks = _inputs((30, 20), seed=5)
    ta = _run("task_arithmetic", base, tasks, [0, 600], _params("task_arithmetic"))
    changed = []
    for k in (0, 1, 2, 3):
        p = _params("consensus_ta", k=[k] * 3, **{"lambda": [0.5] * 3})
        got = _run("consensus_ta", base, tasks, [0, 600], p)
        if k == 0:
            assert _same(got, ta)
        changed.append(int((got != base).sum()))
    assert changed == sorted(changed, reverse=True) and changed[-1] < changed[0]


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("models")
    return build_model_set(root, base_dtype=torch.float32, base_shard="100KB", seed=11)


ENGINE = {
    "consensus_ta": dict(
        parameters={"k": 2},
        task_parameters=(
            {"weight": 1.0, "lambda": 0.5},
            {"weight": 0.5, "lambda": 0.3},
            {"weight": 0.8, "lambda": 0.6},
        ),
    ),
    "consensus_ties": dict(
        parameters={"k": 2, "rescale": True},
        task_parameters=(
            {"weight": 1.0, "density": 0.3, "lambda": 0.4},
            {"weight": 0.5, "density": 0.6, "lambda": 0.4},
            {"weight": 0.8, "density": 1.0, "lambda": 0.4},
        ),
    ),
}


def _resolved(method: str) -> dict:
    case = ENGINE[method]
    per_task = case["task_parameters"]
    out = _params(method, **case["parameters"])
    for name in ("weight", "density", "lambda"):
        defaults = out[name]
        out[name] = [p.get(name, d) for p, d in zip(per_task, defaults, strict=True)]
    out["k"] = [case["parameters"]["k"]] * 3
    return out


def _digests(out: Path) -> tuple[str, ...]:
    return tuple(hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.sa*")))


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("method", sorted(ENGINE))
def test_engine_at_one_row_per_unit_and_whole_tensors_is_the_reference(models, tmp_path, method):
    base_dir, task_dirs, base, tasks = models
    params = _resolved(method)
    want = {
        name: _reference(method, b, [t[name] for t in tasks], params) for name, b in base.items()
    }
    row = max(x.shape[-1] for x in base.values()) * 4  # float32: the widest row
    digests = set()
    for budget, kernels in ((row, "auto"), (10**8, "eager")):
        out = tmp_path / f"{budget}-{kernels}"
        report = run_merge(
            MergeConfig(
                base=str(base_dir), tasks=tuple(map(str, task_dirs)), out=str(out),
                method=method, unit_budget_bytes=budget, kernels=kernels, **ENGINE[method],
            )
        ).data  # fmt: skip
        merged = load_checkpoint(out)
        assert merged.keys() == want.keys()
        for name, w in want.items():
            assert _same(merged[name], w), (budget, name)
        assert (report["passes"]["map"]["fused_elements"] > 0) == (kernels == "auto")
        assert ("ties" in report) == (method == "consensus_ties")
        digests.add(_digests(out))
        card = (out / "README.md").read_text()
        assert f"(`{method}`)" in card and "Wang et al. 2024" in card
    assert len(digests) == 1


@pytest.mark.usefixtures("ray_local")
def test_a_mergekitty_config(models, tmp_path):
    """mergekitty's keys: `k` and `lambda` at the top level (its per-model parameters, given
    once for all), weights and densities per model; the written config replays the bytes."""
    base_dir, task_dirs, base, tasks = models
    config = {
        "merge_method": "consensus_ties",
        "base_model": str(base_dir),
        "dtype": "float32",
        "parameters": {"k": 2, "lambda": 0.6, "int8_mask": True},
        "models": [
            {"model": str(t), "parameters": {"weight": w, "density": d}}
            for t, w, d in zip(task_dirs, (1.0, 0.6, 0.9), (0.5, 0.4, 0.7), strict=True)
        ],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "ours"
    run_merge(MergeConfig(**(load_yaml(str(path)) | {"out": str(out), "unit_budget_bytes": 3000})))
    merged = load_checkpoint(out)
    params = _params(
        "consensus_ties", weight=[1.0, 0.6, 0.9], density=[0.5, 0.4, 0.7], k=[2] * 3,
        **{"lambda": [0.6] * 3},
    )  # fmt: skip
    for name, b in base.items():
        want = _reference("consensus_ties", b, [t[name] for t in tasks], params)
        assert _same(merged[name], want), name
    written = yaml.safe_load((out / "mergekit_config.yml").read_text())
    assert written["merge_method"] == "consensus_ties"
    again = tmp_path / "again"
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(written))
    kwargs = load_yaml(str(tmp_path / "again.yaml")) | {"out": str(again)}
    run_merge(MergeConfig(**kwargs))
    assert _digests(again) == _digests(out)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "consensus_ta", "--k", "4"], "k is 4 but there are 3 tasks"),
        (["--method", "consensus_ties", "--k", "-1"], "parameter k must be >= 0"),
        (
            ["--method", "consensus_ties", "--k", "1", "--k", "2", "--k", "2"],
            "parameter k must be the same for every task",
        ),  # fmt: skip
        (
            ["--method", "consensus_ta", "--consensus-lambda", "-0.5"],
            "parameter lambda must be >= 0",
        ),
        (["--method", "consensus_ta", "--density", "0.5"], "consensus_ta has no density"),
        (["--method", "consensus_ties", "--density", "0"], "density must be in (0, 1]"),
        (["--method", "consensus_ties", "--gamma", "0.1"], "gamma"),
    ],
)
def test_bad_parameters_are_refused_before_any_work(models, tmp_path, capsys, extra, message):
    base_dir, task_dirs, _, _ = models
    line = merge_refused(capsys, base_dir, task_dirs, tmp_path / "out", *extra)
    assert message in line, line
