"""mergekit's YAML schema and parameter rules (`ram_dist.mergekit_config`: reading,
resolving, writing).

Hand-checked tests of every rule, then the same configurations planned by mergekit itself
(LGPL, a test-time oracle only): its `MergePlanner` resolves every parameter of every tensor of
a tiny Llama/Qwen2 (config.json plus one-element tensors: planning reads names, not values),
and `resolve_parameter` must give the same value for each.
"""

from __future__ import annotations

import ast
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml

import ram_dist.mergekit_config as mc
from ram_dist.dtypes import parse_out_dtype
from ram_dist.errors import RamDistError
from ram_dist.mergekit_config import (
    REQUIRED,
    Filtered,
    FilterEntry,
    Gradient,
    JobSpec,
    ParamMap,
    effective_config,
    layer_index,
    load_mergekit_yaml,
    num_layers,
    parse_mergekit_config,
    parse_setting,
    position,
    render,
    resolve,
    resolve_parameter,
    resolve_tensor,
)
from ram_dist.methods.parameters import PARAMETERS, handed

WHERE = "jobs/merge.yaml"


def parse(text: str) -> JobSpec:
    return parse_mergekit_config(yaml.safe_load(text), WHERE)


def fails(text: str, *needles: str) -> str:
    with pytest.raises(RamDistError) as e:
        parse(text)
    msg = str(e.value)
    assert WHERE in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


BASIC = """
merge_method: ties
base_model: base
models:
  - model: base
  - model: a
    parameters: {weight: 0.7, density: 0.5}
  - model: b
    parameters: {weight: 1, density: 1e-1}
parameters: {normalize: true, lambda: 1.5, epsilon: 1e-5}
"""


# ---------------------------------------------------------------------------------------------
# Reading: the JobSpec


@pytest.mark.quick
def test_basic_config() -> None:
    spec = parse(BASIC)
    assert spec.merge_method == "ties"
    assert spec.base_model == "base"
    assert [m.model for m in spec.models] == ["a", "b"]  # the base is not a task
    assert dict(spec.models[0].parameters) == {"weight": 0.7, "density": 0.5}
    # ints and YAML-1.1 strings like 1e-1 become floats
    assert dict(spec.models[1].parameters) == {"weight": 1.0, "density": 0.1}
    assert isinstance(spec.models[1].parameters["weight"], float)
    assert dict(spec.parameters) == {"normalize": True, "lambda": 1.5}
    assert spec.tokenizer_source is None and spec.dtype is None and spec.out_dtype is None
    assert any("epsilon ignored: ties has no parameter epsilon" in n for n in spec.notes)
    assert spec.where == WHERE


def test_jobspec_is_hashable_and_picklable() -> None:
    text = BASIC.replace("weight: 0.7", "weight: [{filter: mlp, value: [0.1, 0.2]}, {value: 1}]")
    spec = parse(text + "storage_options: {s3: {key: K}}\n")
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and hash(again) == hash(spec)
    assert again.storage_options == {"s3": {"key": "K"}}
    assert "K" not in repr(spec)  # storage options may hold secrets
    w = spec.models[0].parameters["weight"]
    assert w == Filtered((FilterEntry("mlp", Gradient((0.1, 0.2))), FilterEntry(None, 1.0)))
    assert hash(w) == hash(pickle.loads(pickle.dumps(w)))


@pytest.mark.quick
def test_param_map() -> None:
    m = ParamMap.of({"b": 1.0, "a": True})
    assert list(m) == ["a", "b"] and len(m) == 2 and m["b"] == 1.0 and "a" in m
    assert m == ParamMap.of({"a": True, "b": 1.0}) and hash(m) == hash(ParamMap.of(dict(m)))
    with pytest.raises(KeyError):
        m["c"]


@pytest.mark.quick
def test_numbers_written_as_yaml_strings() -> None:
    spec = parse(
        "merge_method: ram_plus\nbase_model: b\nmodels: [{model: t1}, {model: t2}]\n"
        "parameters:\n  epsilon: 1e-5\n  r: [1e-1, '2E-1']\n"
        "  alpha: [{filter: mlp, value: 5e-1}]\n"
    )
    assert spec.parameters["epsilon"] == 1e-5
    assert spec.parameters["r"] == Gradient((0.1, 0.2))
    assert spec.parameters["alpha"] == Filtered((FilterEntry("mlp", 0.5),))


def test_bool_values_as_mergekit_reads_them() -> None:
    spec = parse(BASIC.replace("normalize: true", "normalize: 1.0, rescale: 'off'"))
    assert spec.parameters["normalize"] is True and spec.parameters["rescale"] is False
    fails(
        BASIC.replace("normalize: true", "normalize: 0.5"), "parameters.normalize", "true or false"
    )


def test_single_filter_entry_and_filter_values_with_gradients() -> None:
    spec = parse(BASIC.replace("weight: 0.7", "weight: {filter: mlp, value: [1, 2]}"))
    assert spec.models[0].parameters["weight"] == Filtered(
        (FilterEntry("mlp", Gradient((1.0, 2.0))),)
    )


def test_base_entry_with_parameters_is_ignored_with_a_note() -> None:
    spec = parse(
        BASIC.replace("  - model: base\n", "  - model: base\n    parameters: {weight: 9}\n")
    )
    assert [m.model for m in spec.models] == ["a", "b"]
    assert any("models[0] is the base_model" in n and "weight" in n for n in spec.notes)


def test_base_not_listed_is_fine() -> None:
    spec = parse(BASIC.replace("  - model: base\n", ""))
    assert [m.model for m in spec.models] == ["a", "b"] and spec.base_model == "base"


def test_linear_keeps_the_base_as_an_input() -> None:
    listed = parse(
        "merge_method: linear\nbase_model: b\n"
        "models: [{model: t1, parameters: {weight: 1}}, {model: b, parameters: {weight: 2}}]\n"
    )
    assert [(m.model, dict(m.parameters)) for m in listed.models] == [
        ("t1", {"weight": 1.0}),
        ("b", {"weight": 2.0}),
    ]
    appended = parse("merge_method: linear\nbase_model: b\nmodels: [{model: t1}, {model: t2}]\n")
    assert [m.model for m in appended.models] == ["t1", "t2", "b"]
    assert any("averaged as one more input" in n for n in appended.notes)
    baseless = parse("merge_method: linear\nmodels: [{model: t1}, {model: t2}]\n")
    assert baseless.base_model is None and len(baseless.models) == 2 and not baseless.notes


def test_notes_for_what_mergekit_ignores() -> None:
    text = BASIC.replace("normalize: true", "normalize: true, int8_mask: true").replace(
        "{weight: 0.7, density: 0.5}", "{weight: 0.7, density: 0.5, lambda: 3}"
    )
    spec = parse(text + "dtype: bfloat16\n")
    assert "int8_mask" not in spec.parameters
    assert "lambda" not in spec.models[0].parameters
    notes = "\n".join(spec.notes)
    assert "parameters.int8_mask accepted and ignored" in notes
    assert "models[1].parameters.lambda ignored: lambda is a global parameter" in notes
    assert "dtype bfloat16 accepted, but ram-dist computes in float32" in notes
    assert not any("dtype" in n for n in parse(BASIC + "dtype: float32\n").notes)
    ta = parse(text.replace("ties", "task_arithmetic") + "dtype: float32\n")
    assert "density" not in ta.models[0].parameters  # no sparsification in task_arithmetic
    assert "models[1].parameters.density accepted and ignored" in "\n".join(ta.notes)
    ram = parse(BASIC.replace("ties", "ram"))
    assert all(not m.parameters for m in ram.models) and set(ram.parameters) == {"epsilon"}
    assert "models[1].parameters.weight ignored: ram has no parameter weight" in "\n".join(
        ram.notes
    )


def test_output_dtype_follows_mergekit() -> None:
    """Without out_dtype, mergekit writes the dtype it computed in (`dtype`); the note says
    what ram-dist computed in and wrote, and the written config says it too."""
    half = parse(BASIC + "dtype: float16\n")
    assert half.out_dtype == "float16"
    note = next(n for n in half.notes if "dtype" in n)
    assert "computes in float32" in note and "writes float16, as mergekit writes it" in note
    assert "dtype: float32 and out_dtype: float16" in note
    written = effective_config("ties", "base", ["a", "b"], {}, parse_out_dtype(half.out_dtype))
    assert written["dtype"] == "float32" and written["out_dtype"] == "float16"
    assert parse(BASIC + "dtype: float32\n").out_dtype == "float32"
    both = parse(BASIC + "dtype: float16\nout_dtype: bfloat16\n")
    assert both.out_dtype == "bfloat16" and "writes bfloat16;" in "\n".join(both.notes)
    assert parse(BASIC).out_dtype is None  # neither: the CLI's default (the base's dtype)


def test_catch_all_before_other_entries_is_noted() -> None:
    spec = parse(BASIC.replace("weight: 0.7", "weight: [{value: 1}, {filter: mlp, value: 2}]"))
    assert any("entries after [0]" in n and "never apply" in n for n in spec.notes)
    assert not any("never apply" in n for n in parse(BASIC).notes)


def test_tokenizer_source_base_or_absent() -> None:
    assert parse(BASIC + "tokenizer_source: base\n").tokenizer_source == "base"
    for other in ("union", "a", "{model: a}"):
        fails(
            BASIC + f"tokenizer_source: {other}\n",
            "tokenizer_source",
            "not supported",
            "tokenizer_source: base",
        )


@pytest.mark.parametrize(
    "key", ["slices", "modules", "tokenizer", "chat_template", "merge_method_sequence"]
)
def test_unsupported_keys(key: str) -> None:
    fails(BASIC + f"{key}: x\n", repr(key), "not supported")


def test_unknown_key_lists_the_valid_keys() -> None:
    msg = fails(BASIC + "merge_methdo: ties\n", "unknown key 'merge_methdo'", "valid keys")
    for key in mc.TOP_KEYS:
        assert key in msg
    fails(
        BASIC.replace("  - model: a\n", "  - model: a\n    weight: 1\n"),
        "models[1]",
        "unknown key 'weight'",
        "model, parameters",
    )


def test_unknown_parameter_lists_the_valid_ones() -> None:
    msg = fails(
        BASIC.replace("lambda: 1.5", "lamda: 1.5"), "unknown parameter 'lamda'", "valid for ties"
    )
    for name in ("normalize", "lambda", "rescale", "int8_mask", "weight", "density"):
        assert name in msg
    fails(
        BASIC.replace("density: 0.5", "sharpness: 0.5"),
        "models[1].parameters",
        "unknown parameter 'sharpness'",
        "valid for ties per model: weight, density",
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    "text, needles",
    [
        ("[1, 2]", ["expected a mapping"]),
        ("models: [{model: a}]", ["merge_method is required"]),
        (
            "merge_method: frankenmerge\nmodels: [{model: a}]",
            ["'frankenmerge' is not supported", "ties"],
        ),
        ("merge_method: ties\nmodels: [{model: a}]", ["ties needs a base_model"]),
        ("merge_method: ties\nbase_model: b\n", ["models must be a non-empty list"]),
        ("merge_method: ties\nbase_model: b\nmodels: [{model: b}]", ["no model besides"]),
        ("merge_method: ties\nbase_model: b\nmodels: [a]", ["models[0] must be a mapping"]),
        ("merge_method: ties\nbase_model: b\nmodels: [{parameters: {}}]", ["needs a model"]),
        ("merge_method: ties\nbase_model: b\nmodels: [{model: {path: a}}]", ["a string"]),
        (
            "merge_method: ties\nbase_model: b\nmodels: [{model: a}, {model: a}]",
            ["models[1]", "listed twice"],
        ),
        (
            "merge_method: ties\nbase_model: b\nmodels: [{model: a+lora}]",
            ["'a+lora' applies the adapter to 'a', which is not the base_model ('b')"],
        ),
        (
            "merge_method: ties\nbase_model: b+lora\nmodels: [{model: a}]",
            ["is a model+LoRA reference", "give the adapter as one of the models"],
        ),
        ("merge_method: ties\nbase_model: b\nmodels: [{model: b+x+y}]", ["is not MODEL+ADAPTER"]),
        ("merge_method: ties\nbase_model: 3\nmodels: [{model: a}]", ["base_model must be"]),
    ],
)
def test_structure_errors(text: str, needles: list[str]) -> None:
    fails(text, *needles)


@pytest.mark.quick
@pytest.mark.parametrize(
    "weight, needles",
    [
        ("abc", ["models[1].parameters.weight", "finite number", "'abc'"]),
        ("true", ["finite number"]),
        (".inf", ["finite number"]),
        ("null", ["finite number"]),
        ("[]", ["empty list"]),
        ("[1, [2]]", ["cannot mix"]),
        ("[1, {value: 2}]", ["cannot mix"]),
        ("[{filter: mlp}]", ["weight[0]", "needs a value"]),
        ("[{filter: mlp, vlaue: 1}]", ["unknown key 'vlaue'", "filter, value"]),
        ("[{filter: 3, value: 1}]", ["filter must be a string"]),
        ("[{value: {value: 1}}]", ["cannot nest"]),
        ("[{value: [1, {value: 2}]}]", ["cannot nest"]),
        ("[{value: [1, x]}]", ["weight[0].value[1]", "finite number"]),
    ],
)
def test_value_errors(weight: str, needles: list[str]) -> None:
    fails(BASIC.replace("weight: 0.7", f"weight: {weight}"), *needles)


def test_dtype_names() -> None:
    spec = parse(BASIC + "dtype: torch.float32\nout_dtype: bf16\n")
    assert spec.dtype == "torch.float32" and spec.out_dtype == "bf16" and not spec.notes[1:]
    fails(BASIC + "out_dtype: int8\n", "out_dtype 'int8'", "bfloat16")
    fails(BASIC + "dtype: fp8\n", "dtype 'fp8'")


def test_storage_options_shape() -> None:
    fails(BASIC + "storage_options: [s3]\n", "storage_options must map a protocol")
    fails(BASIC + "storage_options: {s3: 1}\n", "storage_options must map a protocol")


@pytest.mark.quick
def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(BASIC)
    assert load_mergekit_yaml(str(path)) == parse(BASIC)
    path.write_text("a: [1,\n")
    with pytest.raises(RamDistError, match="not valid YAML"):
        load_mergekit_yaml(str(path))
    with pytest.raises(RamDistError, match="cannot read config"):
        load_mergekit_yaml(str(tmp_path / "missing.yaml"))
    path.write_text("merge_method: ties\nslices: []\n")
    with pytest.raises(RamDistError, match=str(path)):
        load_mergekit_yaml(str(path))


# ---------------------------------------------------------------------------------------------
# Position and resolution


LLAMA_LAYER = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.up_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.down_proj.weight",
)
QWEN2_LAYER = (
    *LLAMA_LAYER,
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
)


def tensor_names(n_layers: int, layer: tuple[str, ...] = LLAMA_LAYER) -> list[str]:
    inner = [f"model.layers.{i}.{s}" for i in range(n_layers) for s in layer]
    return ["model.embed_tokens.weight", *inner, "model.norm.weight", "lm_head.weight"]


def test_layer_index() -> None:
    assert layer_index("model.layers.0.self_attn.q_proj.weight") == 0
    assert layer_index("model.layers.17.mlp.experts.3.w1.weight") == 17
    assert layer_index("model.layers.2.self_attn.q_proj.bias") == 2
    assert layer_index("transformer.h.5.attn.c_attn.weight") == 5
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.rotary_emb.inv_freq",
        "encoder.layers.3.fc.weight",
        "layers",
    ):
        assert layer_index(name) is None


def test_layer_index_agrees_with_mergekit_architectures() -> None:
    """Every single-stack mergekit architecture with a decoder prefix we know: its layer
    templates are layers, its pre/post weights are not."""
    arch_data = pytest.importorskip("mergekit._data.architectures")
    checked = 0
    for path in sorted(Path(arch_data.__file__).parent.glob("*.json")):
        arch = json.loads(path.read_text())
        templates = [w["name"] for w in arch.get("layer_templates", {}).get("weights", [])]
        if not templates or layer_index(templates[0].replace("${layer_index}", "7")) is None:
            continue
        for template in templates:
            assert layer_index(template.replace("${layer_index}", "7")) == 7, template
            assert layer_index(template.replace("${layer_index}", "12")) == 12, template
        for weight in arch.get("pre_weights", []) + arch.get("post_weights", []):
            assert layer_index(weight["name"]) is None, weight["name"]
        checked += 1
    assert checked >= 30


def test_position() -> None:
    assert [position(f"model.layers.{i}.mlp.up_proj.weight", 4) for i in range(4)] == [
        0.0,
        1 / 3,
        2 / 3,
        1.0,
    ]
    assert position("model.layers.0.mlp.up_proj.weight", 1) == 1.0  # a single layer: t = 1
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert position(name, 4) == 0.0  # pre- and post-layer weights alike
    with pytest.raises(RamDistError, match="layer 4, but the model has 4 layers"):
        position("model.layers.4.mlp.up_proj.weight", 4)


@pytest.mark.quick
def test_resolve_gradient_by_hand() -> None:
    g = Gradient((0.0, 1.0, 0.5))
    names = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)]
    # t = 0, .25, .5, .75, 1 -> s = 0, .5, 1, 1.5, 2
    assert [resolve(g, n, 5) for n in names] == [0.0, 0.5, 1.0, 0.75, 0.5]
    assert resolve(g, "model.norm.weight", 5) == 0.0 == resolve(g, "lm_head.weight", 5)
    assert resolve(Gradient((2.0,)), names[3], 5) == 2.0
    bools = Gradient((True, False))
    assert [resolve(bools, n, 5) for n in names] == [True, True, True, True, False]
    scopes = Gradient(("model", "tensor", "model"))
    assert [resolve(scopes, n, 5) for n in names] == ["model"] * 2 + ["tensor"] * 2 + ["model"]
    assert resolve(0.3, names[0], 5) == 0.3 and resolve(True, names[0], 5) is True


def test_parse_setting_for_raw_values() -> None:
    assert parse_setting([1, "2e-1"], "density") == Gradient((1.0, 0.2))
    assert parse_setting({"filter": "mlp", "value": 0}, "normalize") == Filtered(
        (FilterEntry("mlp", False),)
    )
    with pytest.raises(RamDistError, match="unknown parameter 'sharpness'"):
        parse_setting(0.1, "sharpness")
    with pytest.raises(RamDistError, match="x.yaml: weight must be a finite number"):
        parse_setting("abc", "weight", "x.yaml")
    with pytest.raises(TypeError, match="parse_setting"):
        resolve([0.1, 0.2], "model.layers.0.mlp.up_proj.weight", 2)  # type: ignore[arg-type]


@pytest.mark.quick
def test_resolve_filters_by_hand() -> None:
    f = Filtered(
        (
            FilterEntry("self_attn.q_proj", 1.0),
            FilterEntry("self_attn", 2.0),  # after the more specific one: order matters
            FilterEntry("norm", Gradient((3.0, 5.0))),
        )
    )
    assert resolve(f, "model.layers.1.self_attn.q_proj.weight", 3) == 1.0
    assert resolve(f, "model.layers.1.self_attn.k_proj.weight", 3) == 2.0
    assert resolve(f, "model.layers.1.input_layernorm.weight", 3) == 4.0  # t = .5
    assert resolve(f, "model.norm.weight", 3) == 3.0  # t = 0
    assert resolve(f, "model.layers.1.mlp.up_proj.weight", 3) is None  # no entry matches
    first_wins = Filtered((FilterEntry("self_attn", 2.0), FilterEntry("self_attn.q_proj", 1.0)))
    assert resolve(first_wins, "model.layers.0.self_attn.q_proj.weight", 3) == 2.0
    star = Filtered((FilterEntry("mlp", 1.0), FilterEntry("*", 7.0), FilterEntry(None, 8.0)))
    assert resolve(star, "lm_head.weight", 3) == 7.0
    assert resolve(Filtered((FilterEntry(None, 8.0),)), "", 3) == 8.0
    assert resolve(Filtered((FilterEntry("", 8.0),)), "", 3) is None  # empty name: no match


@pytest.mark.quick
def test_resolve_parameter_precedence_by_hand() -> None:
    spec = parse(
        "merge_method: ties\nbase_model: b\nmodels:\n"
        "  - model: t1\n    parameters:\n      weight: [{filter: mlp, value: 0.25}]\n"
        "      density: [0.2, 0.6]\n"
        "  - model: t2\n"
        "parameters:\n  weight: [{filter: self_attn, value: 2}, {value: [1, 3]}]\n"
        "  density: 0.9\n  lambda: [{filter: lm_head, value: 0.5}]\n"
    )
    mlp, attn = "model.layers.1.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"

    def rp(name: str, i: int | None, tensor: str, default=REQUIRED):  # noqa: ANN202
        return resolve_parameter(spec, name, i, tensor, 3, default)

    assert rp("weight", 0, mlp) == 0.25  # the model's own filter
    assert rp("weight", 0, attn) == 2.0  # no match in the model's list: the global one
    assert rp("weight", 0, "model.norm.weight") == 1.0  # global fallback, t = 0
    assert rp("weight", 1, mlp) == 2.0  # t = .5 on [1, 3]
    assert rp("density", 0, mlp) == pytest.approx(0.4) and rp("density", 1, mlp) == 0.9
    assert rp("lambda", None, "lm_head.weight", 1.0) == 0.5
    assert rp("lambda", None, mlp, 1.0) == 1.0  # no match anywhere: the default
    assert rp("normalize", None, mlp, True) is True
    assert rp("weight", None, mlp) == 2.0  # model_index None: global scope only
    with pytest.raises(RamDistError, match=f"{WHERE}: no lambda for tensor {mlp}"):
        rp("lambda", None, mlp)
    with pytest.raises(RamDistError, match="no weight for t1 tensor"):
        resolve_parameter(
            parse(
                "merge_method: ties\nbase_model: b\nmodels:\n"
                "  - model: t1\n    parameters: {weight: [{filter: mlp, value: 1}]}\n"
            ),
            "weight",
            0,
            attn,
            3,
            REQUIRED,
        )


# ---------------------------------------------------------------------------------------------
# Writing


def _resolved(spec: JobSpec, names: list[str]) -> dict[str, dict]:
    """Every tensor's parameters as the engine resolves them
    (`planning.tensor_params.resolve_all`)."""
    handed_ = handed(PARAMETERS[spec.merge_method])
    per_task = [m.parameters for m in spec.models]
    layers = num_layers(names)
    return {n: resolve_tensor(handed_, spec.parameters, per_task, n, layers) for n in names}


ROUND_TRIP = """
merge_method: {method}
base_model: base
models:
  - model: a
    parameters: {{weight: [{{filter: mlp, value: [0.1, 0.2]}}, {{value: 1}}], density: [0.2, 0.9]}}
  - model: b
parameters:
  r: [0.1, 0.3]
  alpha: {{filter: q_proj, value: 0.5}}
  lambda: [{{filter: lm_head, value: 0.5}}, {{value: [1, 2]}}]
  seed: 4
dtype: bfloat16
storage_options: {{s3: {{key: AKIA-SECRET}}}}
"""


@pytest.mark.quick
@pytest.mark.parametrize("method", ["ties", "dare_ties", "ramplus_tl", "linear"])
def test_written_config_resolves_every_tensor_as_the_run_did(method: str) -> None:
    """The one writer states what ran: read back, each tensor gets the same values; the
    reader's notes are comments, storage options are not written."""
    spec = parse(ROUND_TRIP.format(method=method))
    names = tensor_names(3)
    ran = _resolved(spec, names)
    assert len({json.dumps(p) for p in ran.values()}) > 1  # values vary by tensor
    tasks = [m.model for m in spec.models]
    out_dtype = parse_out_dtype(spec.out_dtype)
    written = render(effective_config(method, "base", tasks, ran, out_dtype), spec.notes)
    assert "AKIA" not in written and "s3" not in written
    notes = written.split("merge_method:")[0]
    assert spec.notes and all(f"# note: {n}" in notes for n in spec.notes)
    again = parse_mergekit_config(yaml.safe_load(written), WHERE)
    assert again.out_dtype == "bfloat16" and again.tokenizer_source == "base"
    assert [m.model for m in again.models] == tasks
    assert _resolved(again, names) == ran


def test_package_is_plain_python_without_asserts() -> None:
    """No assert on user input, no torch: the reader, the resolution and the writer, and the
    tables they read."""
    from ram_dist.methods import decoder_layers, parameters

    files = [*Path(mc.__file__).parent.glob("*.py"), Path(decoder_layers.__file__)]
    trees = [ast.parse(f.read_text()) for f in [*files, Path(parameters.__file__)]]
    assert len(files) == 6
    assert not [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for tree in trees
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert imported <= {
        "keyword",
        "__future__",
        "math",
        "re",
        "collections",
        "dataclasses",
        "typing",
        "yaml",
        "ram_dist",
    }


# ---------------------------------------------------------------------------------------------
# Against mergekit's planner


GTA_YAML = """
merge_method: {method}
base_model: {base}
models:
  - model: {base}
  - model: {a}
    parameters:
      weight:
        - {{filter: mlp, value: [0.1, 0.9]}}
        - {{filter: self_attn.q_proj, value: 0.25}}
        - {{filter: self_attn, value: 0.4}}
      density: [1, 0.5, 2e-1]
  - model: {b}
    parameters:
      weight: 0.3
      density: {{filter: layers.1., value: 0.9}}
  - model: {c}
parameters:
  weight: [{{filter: norm, value: 2}}, {{filter: "*", value: [1, 3, 2, -0.5]}}]
  density: [0.7, 0.35]
  normalize: [true, false]
  lambda:
    - {{filter: layers.2., value: [1.5, 0.5]}}
    - {{filter: lm_head, value: 1e-1}}
    - {{filter: embed, value: 2}}
  rescale: [{{filter: k_proj, value: true}}]
  int8_mask: true
dtype: float32
"""

LINEAR_YAML = """
merge_method: linear
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: [{{filter: mlp, value: [0.1, 0.9]}}, {{filter: bias, value: 4}}]
  - model: {b}
    parameters: {{weight: 0.3}}
  - model: {c}
parameters:
  weight: [{{filter: norm, value: 2}}, {{value: [1, 3, 2]}}]
  normalize: [{{filter: lm_head, value: false}}, {{value: [true, false, true]}}]
dtype: float32
"""

RAM_YAML = """
merge_method: ramplus_tl
base_model: {base}
models:
  - model: {base}
  - model: {a}
  - model: {b}
    parameters: {{weight: 5}}
parameters:
  r: [0.1, "3e-1"]
  alpha: [{{filter: mlp, value: [0.2, 0.6, 0.4]}}, {{filter: embed, value: 0.9}}]
  epsilon: [{{filter: self_attn, value: 1e-4}}, {{value: 1e-5}}]
dtype: float32
"""

ARCHS = {"llama": ("LlamaForCausalLM", LLAMA_LAYER), "qwen2": ("Qwen2ForCausalLM", QWEN2_LAYER)}


def _tiny_model(folder: Path, kind: str, n_layers: int) -> list[str]:
    """config.json plus one-element tensors: what mergekit's planner reads."""
    from safetensors.numpy import save_file

    arch, layer = ARCHS[kind]
    folder.mkdir(parents=True)
    config = {
        "architectures": [arch],
        "model_type": kind,
        "num_hidden_layers": n_layers,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 16,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    names = tensor_names(n_layers, layer)
    save_file({n: np.zeros(1, np.float32) for n in names}, str(folder / "model.safetensors"))
    return names


def _mergekit_plan(text: str, out: Path) -> list:
    """mergekit's planned merge tasks, one per output tensor (nothing is loaded or merged)."""
    mk_config = pytest.importorskip("mergekit.config")
    from mergekit.architecture import get_architecture_info
    from mergekit.common import ModelReference
    from mergekit.options import MergeOptions
    from mergekit.plan import MergePlanner

    config = mk_config.MergeConfiguration.model_validate(yaml.safe_load(text))
    options = MergeOptions()
    arch = get_architecture_info(config, options)
    out_config = ModelReference.model_validate(str(config.base_model)).config()
    tasks = MergePlanner(config, arch, options, out_config).plan_to_disk(str(out))
    return [t for t in tasks if hasattr(t, "tensor_task")]


def _same(ours, theirs) -> bool:  # noqa: ANN001
    """The same value and type (Python floats: the same bits)."""
    if isinstance(theirs, float):
        return type(ours) is float and (ours == theirs or math.isnan(ours) and math.isnan(theirs))
    return type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize(
    "template, method, kind, n_layers",
    [
        (GTA_YAML, "ties", "llama", 4),
        (GTA_YAML, "dare_ties", "qwen2", 5),
        (GTA_YAML, "task_arithmetic", "llama", 1),
        (GTA_YAML, "dare_linear", "llama", 2),
        (LINEAR_YAML, "linear", "qwen2", 4),
        (RAM_YAML, "ramplus_tl", "llama", 3),
    ],
)
def test_every_tensor_resolves_as_mergekit_resolves(
    tmp_path: Path, template: str, method: str, kind: str, n_layers: int
) -> None:
    paths = {m: str(tmp_path / m) for m in ("base", "a", "b", "c")}
    names = [_tiny_model(Path(p), kind, n_layers) for p in paths.values()][0]
    text = template.format(method=method, **paths)
    spec = parse(text)
    planned = _mergekit_plan(text, tmp_path / "out")

    from mergekit.merge_methods import registry

    mk_spec = registry.get(method).spec
    defaults = {p.name: REQUIRED if p.required else p.default for p in mk_spec.parameters}
    no_effect = [p.name for p in PARAMETERS[method] if not p.effect]  # dropped with a note
    assert sorted(t.tensor_name for t in planned) == sorted(names)
    checked = 0
    for save in planned:
        task, name = save.tensor_task, save.tensor_name
        # the inputs mergekit weights, in its order, are spec.models
        order = [str(m) for m in task.model_order]
        base = str(task.base_model) if method != "linear" else None
        assert [m for m in order if m != base] == [m.model for m in spec.models]
        for param, value in task.parameters.items():
            if param in no_effect:
                continue
            ours = resolve_parameter(spec, param, None, name, n_layers, defaults[param])
            assert _same(ours, value), (name, param, ours, value)
            checked += 1
        for model, values in task.input_parameters.items():
            if str(model) == base:
                assert dict(values.items()) == {}  # mergekit reads nothing for the base
                continue
            index = [m.model for m in spec.models].index(str(model))
            for param, value in values.items():
                if param in no_effect:
                    continue
                ours = resolve_parameter(spec, param, index, name, n_layers, defaults[param])
                assert _same(ours, value), (name, str(model), param, ours, value)
                checked += 1
    assert checked >= len(names) * 3
