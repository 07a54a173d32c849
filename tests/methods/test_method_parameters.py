"""One table of method parameters (`ram_dist.methods.parameters`) and everything that reads it:
the methods, the CLI flags, the YAML reader, the engine's resolution, the model card, and the
one rule of what a layer is, shared by parameter gradients and the per-layer report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from ram_dist.cli import build_parser, config_from_args
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config import (
    REQUIRED,
    Gradient,
    num_layers,
    parse_mergekit_config,
    resolve,
    resolve_parameter,
    resolve_tensor,
)
from ram_dist.methods import METHODS, get_method
from ram_dist.methods.decoder_layers import layer_index, layer_name
from ram_dist.methods.parameters import BY_NAME, PARAMETERS, cli_parameters, handed
from ram_dist.methods.ram import layer_summary
from ram_dist.planning.config import MergeConfig, load_yaml
from ram_dist.planning.tensor_params import resolve_all
from ram_dist.report.model_card import model_card

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def test_every_method_takes_the_parameters_the_table_declares() -> None:
    assert list(METHODS) == list(PARAMETERS)
    for name, method in METHODS.items():
        assert method.parameters == PARAMETERS[name]  # each method declares its own
    defaults = {m: {p.name: p.default for p in PARAMETERS[m]} for m in PARAMETERS}
    assert defaults["ram_plus"] == {"r": 0.1, "alpha": 2.0, "epsilon": 1e-5, "scope": "model"}
    assert defaults["ramplus_tl"]["alpha"] == 0.2 and defaults["ramplus_tl"]["scope"] == "tensor"
    assert defaults["ties"]["normalize"] is True and defaults["ties"]["rescale"] is False
    assert defaults["dare_linear"]["rescale"] is True and defaults["dare_ties"]["seed"] == 0
    assert defaults["linear"] == {"weight": 1.0, "normalize": True}
    # mergekitty's consensus methods: k and lambda per task (lambda the TALL threshold)
    for name, normalize in (("consensus_ta", False), ("consensus_ties", True)):
        assert defaults[name]["k"] == 1 and defaults[name]["lambda"] == 1.0
        assert defaults[name]["normalize"] is normalize and defaults[name]["rescale"] is False
        per_task = {p.name for p in PARAMETERS[name] if p.per_task}
        assert per_task == {"weight", "density", "k", "lambda"}
    # the engine hands globals first, then per-task ones: the report's and the config's order
    assert [p.name for p in handed(PARAMETERS["dare_ties"])] == [
        "normalize", "lambda", "rescale", "seed", "weight", "density",
    ]  # fmt: skip
    assert [p.name for p in handed(PARAMETERS["task_arithmetic"])] == [
        "normalize", "lambda", "weight", "density",
    ]  # fmt: skip


def _merge_args(*flags: str) -> list[str]:
    return ["merge", "--base", "b", "--task", "t1", "--task", "t2", "--out", "o", *flags]


def test_cli_flags_and_their_help_come_from_the_table() -> None:
    merge = build_parser()._subparsers._group_actions[0].choices["merge"]  # type: ignore[union-attr]
    helps = {s: a.help for a in merge._actions for s in a.option_strings}
    flagged = {p.cli_flag for ps in PARAMETERS.values() for p in ps if p.cli_flag}
    assert flagged == {"--r", "--alpha", "--eps", "--weight", "--density", "--lambda",
                       "--normalize", "--rescale", "--seed", "--filter-wise", "--select-topk",
                       "--t", "--scale", "--nuslerp-flatten", "--nuslerp-row-wise",
                       "--normalize-weights", "--max-iter", "--tol", "--gamma", "--k",
                       "--della-epsilon", "--nearswap-t", "--consensus-lambda"}  # fmt: skip
    for p, text in cli_parameters():
        assert helps[p.cli_flag] == text and text.startswith(p.help)
    assert "ramplus_tl: default 0.2" in helps["--alpha"]
    assert "ties, della, linear: default true" in helps["--normalize"]
    assert "task_arithmetic" not in helps["--density"]  # no effect there
    args = build_parser().parse_args(
        _merge_args("--method", "dare_ties", "--eps", "1e-4", "--lambda", "0.5", "--no-normalize",
                    "--seed", "3", "--weight", "1", "--weight", "2", "--density", "0.4")
    )  # fmt: skip
    config = config_from_args(args)
    assert config.parameters == {"epsilon": 1e-4, "lambda": 0.5, "normalize": False, "seed": 3}
    assert config.task_parameters == (
        {"weight": 1.0, "density": 0.4},
        {"weight": 2.0, "density": 0.4},
    )


def test_yaml_reads_what_the_table_declares_and_notes_the_rest() -> None:
    for method, params in PARAMETERS.items():
        # a required parameter (default None: slerp's t) is given a value of its kind
        given = {name: 0.5 if p.default is None else p.default for name, p in BY_NAME.items()}
        raw = {"merge_method": method, "base_model": "b", "models": [{"model": "t"}]}
        spec = parse_mergekit_config(raw | {"parameters": given}, "x.yaml")
        assert set(spec.parameters) == {p.name for p in params if p.effect}, method
        ignored = set(given) - set(spec.parameters)
        notes = "\n".join(spec.notes)
        assert all(f"parameters.{name} " in notes for name in ignored), (method, notes)
    with pytest.raises(RamDistError, match="parameters.seed must be an integer"):
        parse_mergekit_config(raw | {"parameters": {"seed": 1.5}}, "x.yaml")


ENGINE_YAML = """
merge_method: ties
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: [{{filter: mlp, value: [0.1, 0.9]}}]
      density: [0.2, 0.8]
  - model: {b}
parameters:
  weight: [{{filter: self_attn, value: 2}}, {{value: [1, 3]}}]
  lambda: [{{filter: lm_head, value: 0.5}}]
"""

NAMES = [
    "model.embed_tokens.weight",
    *[f"model.layers.{i}.{s}" for i in range(3) for s in ("mlp.up.weight", "self_attn.q.weight")],
    "model.norm.weight",
    "lm_head.weight",
]


def test_engine_resolves_with_the_readers_precedence(tmp_path: Path) -> None:
    """`planning.tensor_params.resolve_all` (what the merge runs with) and
    `resolve_parameter` give every parameter of every tensor the same value."""
    text = ENGINE_YAML.format(base="/b", a="/a", b="/c")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    config = MergeConfig(**load_yaml(str(path)))
    spec = parse_mergekit_config(yaml.safe_load(text), str(path))
    resolved = resolve_all(config, get_method("ties"), NAMES)
    layers = num_layers(NAMES)
    assert layers == 3
    checked = 0
    for name in NAMES:
        for p in handed(PARAMETERS["ties"]):
            for i in range(2) if p.per_task else [None]:
                want = resolve_parameter(spec, p.name, i, name, layers, p.default)
                got = resolved[name][p.name][i] if p.per_task else resolved[name][p.name]
                assert got == want, (name, p.name, i)
                checked += 1
    assert checked == len(NAMES) * 7
    assert resolved["model.layers.1.mlp.up.weight"]["weight"] == [0.5, 2.0]
    assert resolved["lm_head.weight"]["lambda"] == 0.5
    with pytest.raises(RamDistError, match="no lambda for tensor model.layers.0.mlp.up"):
        resolve_parameter(spec, "lambda", None, NAMES[1], layers, REQUIRED)


GROUPED_YAML = """
merge_method: ties
base_model: /b
models:
  - model: /a
    parameters: {{weight: {a_weight}, density: [0.2, 0.8]}}
  - model: /c
    parameters: {{density: 0.5}}
parameters:
  lambda: {lam}
"""


@pytest.mark.parametrize(
    ("a_weight", "lam"), [("0.5", "1.0"), ("[0.1, 0.9]", "1.0"), ("0.5", "[0.5, 2.0]")]
)
def test_tensors_of_one_layer_or_model_resolve_once_with_the_same_values(
    tmp_path: Path, a_weight: str, lam: str
) -> None:
    """Without filter lists, tensors of one layer (or all, without gradients) are resolved
    once: the same values as one by one, in their own dicts and lists; a bad value still
    names the first tensor that has it."""
    path = tmp_path / "job.yaml"
    path.write_text(GROUPED_YAML.format(a_weight=a_weight, lam=lam))
    config = MergeConfig(**load_yaml(str(path)))
    method = get_method("ties")
    resolved = resolve_all(config, method, NAMES)
    per_task = list(config.task_parameters)
    one_by_one = {
        n: resolve_tensor(handed(method.parameters), config.parameters, per_task, n, 3)
        for n in NAMES
    }
    assert resolved == one_by_one
    assert len({id(v["weight"]) for v in resolved.values()}) == len(NAMES)
    path.write_text(GROUPED_YAML.format(a_weight=a_weight, lam=lam).replace("0.8]", "1.5]"))
    config = MergeConfig(**load_yaml(str(path)))
    with pytest.raises(RamDistError, match="tensor 'model.layers.2.mlp.up.weight': param"):
        resolve_all(config, method, NAMES)  # the last layer's density is 1.5


GPT2 = [
    "transformer.wte.weight",
    *[
        f"transformer.h.{i}.{s}"
        for i in range(3)
        for s in ("attn.c_attn.weight", "mlp.c_fc.weight")
    ],
    "transformer.ln_f.weight",
    "encoder.layers.0.fc.weight",  # not a decoder layer: neither for parameters nor the report
]


@pytest.mark.parametrize("names", [GPT2, NAMES], ids=["gpt2", "llama"])
def test_report_layers_are_the_layers_parameters_vary_across(names: list[str]) -> None:
    """mergekit treats GPT-2's `transformer.h.N` as layer N; so do the parameter gradients
    and the per-layer report, with one rule (`methods.decoder_layers`)."""
    totals = {n: torch.full((3, 3), k + 1, dtype=torch.int64) for k, n in enumerate(names)}
    report = layer_summary(totals)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(layer_name(n) or "other", []).append(n)
    stem = names[1].rsplit(".", 3)[0].rsplit(".", 1)[0]  # transformer.h / model.layers
    assert [entry["layer"] for entry in report] == [f"{stem}.{i}" for i in range(3)] + ["other"]
    gradient, layers = Gradient((0.0, 1.0)), num_layers(names)
    for entry in report:
        members = groups[entry["layer"]]
        participating = sum(3 * (names.index(n) + 1) for n in members)
        assert entry["tasks"][0]["participating"] == participating
        values = {resolve(gradient, n, layers) for n in members}
        index = layer_index(members[0])
        assert values == ({index / 2} if entry["layer"] != "other" else {0.0})


def test_card_lists_the_parameters_with_an_effect_and_their_meaning() -> None:
    report = {
        "method": "task_arithmetic",
        "parameters": {"normalize": False, "lambda": 0.5, "weight": [1.0, 2.0],
                       "density": [1.0, 1.0], "hf_token": "secret"},
        "out_dtype": "BF16",
        "tasks_given": ["a", "b"],
    }  # fmt: skip
    card = model_card(report, base="b", inputs=[], version="0")
    section = card.split("## Parameters")[1].split("## Inputs")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert rows == [
        "| normalize | false | divide by the sum of the weights |",
        "| lambda | 0.5 | scale of the merged task vector |",
        "| weight | [1.0, 2.0] | weight of each task |",
        "| out_dtype | bfloat16 | dtype of the merged tensors |",
    ]
