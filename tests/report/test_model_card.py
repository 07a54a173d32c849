"""The merged model's card: a Hugging Face README.md whose metadata parses as YAML."""

from __future__ import annotations

import copy

import pytest
import yaml
from hand_report import hand_report

from ram_dist.report.model_card import format_parameters, hub_repo_id, model_card, redact_location

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

SHA = "ab" * 32


def identity(role: str, location: str, files: int = 1) -> dict:
    """An input as the manifest records it."""
    return {
        "role": role,
        "location": location,
        "files": {
            f"model-0000{k + 1}-of-0000{files}.safetensors": {
                "size": 1000 + k,
                "header_sha256": f"{k:02d}" + SHA[2:],
                "version": f'"etag-{role.replace(" ", "")}-{k}"',
            }
            for k in range(files)
        },
    }


def merge_report() -> dict:
    report = hand_report()
    report["output"] = {
        "url": "/models/merged",
        "files_copied": ["config.json", "tokenizer.json", "tokenizer_config.json"],
        "shards_reused": [],
        "shards_written": ["model.safetensors"],
    }
    report["passes"]["map"] = dict(report["passes"]["reduce"], bytes_written=2048)
    return report


INPUTS = [identity("base model", "/data/base", files=2)] + [
    identity(f"task {i}", f"/data/agents/agent{i}") for i in (1, 2, 3)
]


def metadata(card: str) -> dict:
    """The YAML between the leading `---` lines."""
    lines = card.splitlines()
    assert lines[0] == "---"
    end = lines.index("---", 1)
    return yaml.safe_load("\n".join(lines[1:end]))


def test_metadata_block_parses_and_names_the_base_model() -> None:
    card = model_card(merge_report(), base="/data/base", inputs=INPUTS, version="0.1.0")
    meta = metadata(card)
    assert meta["base_model"] == "/data/base"
    assert meta["tags"] == ["merge", "ram-dist"]
    assert meta["library_name"] == "transformers"


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("hf://Qwen/Qwen2.5-7B-Instruct@main", "Qwen/Qwen2.5-7B-Instruct"),
        ("Qwen/Qwen2.5-7B-Instruct@v1.0", "Qwen/Qwen2.5-7B-Instruct"),
        ("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-3B-Instruct"),
        ("/models/qwen base: #1", "/models/qwen base: #1"),  # YAML-special characters
    ],
)
def test_base_model_is_the_hub_id_or_the_location(base: str, expected: str) -> None:
    card = model_card(merge_report(), base=base, inputs=INPUTS, version="0.1.0")
    assert metadata(card)["base_model"] == expected


def test_card_states_method_inputs_statistics_version_and_loading() -> None:
    card = model_card(merge_report(), base="/data/base", inputs=INPUTS, version="9.8.7")
    assert "ram-dist 9.8.7" in card
    assert "RAM+" in card and "`ram_plus`" in card
    for name, value in (("r", "0.1"), ("alpha", "2.0"), ("epsilon", "1e-05")):
        assert f"| {name} | {value} |" in card
    for entry in INPUTS:  # every input file with its identity
        for file, ident in entry["files"].items():
            row = f"| {entry['role']} | `{entry['location']}` | {file} | {ident['size']} | "
            assert row + f"`{ident['header_sha256']}` | {ident['version']} |" in card
    # per task: changed, density, unique, shared, rho, lambda per variant, lambda applied
    assert (
        "| 1 | `/data/agents/agent1` | 40 | 4.00% | 10 | 30 | 3.0000 | 1 | 1.2 | 1.075 | 1.2 |"
        in card
    )
    assert (
        "| 2 | `/data/agents/agent2` | 500 | 50.00% | 250 | 250 | 1.0000 | 1 | 1.1 | 1.05 | 1.1 |"
        in card
    )
    assert "| 3 | `/data/agents/agent3` | 220 | 22.00% | 100 | 120 | 1.2000 |" in card
    assert 'AutoModelForCausalLM.from_pretrained("/models/merged", dtype="auto")' in card
    assert 'AutoTokenizer.from_pretrained("/models/merged")' in card


def test_card_of_a_baseline_gives_its_parameters_only() -> None:
    report = merge_report()
    for key in ("tasks", "elements", "layers", "lambda_applied"):
        del report[key]
    report["output"]["files_copied"] = ["config.json"]
    report |= {
        "method": "ties",
        "parameters": {"normalize": True, "lambda": 1.0, "density": [0.3, 0.5, 0.7]},
        "ties": {"cuts_through_equal_magnitudes": 0},
    }
    card = model_card(report, base="/data/base", inputs=INPUTS, version="0.1.0")
    assert "TIES" in card
    assert "| density | [0.3, 0.5, 0.7] |" in card and "| normalize | true |" in card
    assert "rho" not in card and "lambda_t" not in card
    assert "AutoTokenizer" not in card  # the base had no tokenizer files


def test_parameters_that_vary_by_tensor_are_summarised() -> None:
    params = {
        "model.layers.0.mlp.weight": {"weight": [0.2, 1.0], "normalize": True},
        "model.layers.1.mlp.weight": {"weight": [1.0, 1.0], "normalize": True},
    }
    assert format_parameters(params) == [
        ("weight", "varies by tensor (2 values over 2 tensors; see mergekit_config.yml)"),
        ("normalize", "true"),
    ]
    # every tensor counts, `embed_tokens` too (a tensor name is no secret)
    params["model.embed_tokens.weight"] = {"weight": [1.0, 1.0], "normalize": False}
    assert format_parameters(params, "linear") == [
        ("weight", "varies by tensor (2 values over 3 tensors; see mergekit_config.yml)"),
        ("normalize", "varies by tensor (2 values over 3 tensors; see mergekit_config.yml)"),
    ]


def test_card_holds_no_secret() -> None:
    secrets = ["AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI", "hf_SeCrEtToKeN", "sig=deadbeef"]
    report = merge_report()
    report["storage_options"] = {"s3": {"key": secrets[0], "secret": secrets[1]}}
    report["parameters"] = dict(report["parameters"], hf_token=secrets[2])
    report["output"]["url"] = f"s3://{secrets[0]}:{secrets[1]}@bucket/merged?{secrets[3]}"
    report["tasks"][0]["model"] = f"https://user:{secrets[2]}@example.com/agent1?{secrets[3]}"
    inputs = copy.deepcopy(INPUTS)
    inputs[0]["storage_options"] = {"s3": {"key": secrets[0], "secret": secrets[1]}}
    inputs[1]["location"] = f"s3://{secrets[0]}:{secrets[1]}@bucket/agent1?{secrets[3]}"
    inputs[1]["files"]["model-00001-of-00001.safetensors"]["token"] = secrets[2]
    card = model_card(
        report,
        base=f"s3://{secrets[0]}:{secrets[1]}@bucket/base",
        inputs=inputs,
        version="0.1.0",
    )
    for secret in secrets:
        assert secret not in card
    assert "storage_options" not in card
    assert metadata(card)["base_model"] == "s3://bucket/base"
    assert "`s3://bucket/agent1`" in card and "`https://example.com/agent1`" in card
    assert "# copy s3://bucket/merged to a local folder first" in card


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        ("s3://KEY:SECRET@bucket/a/b?X-Amz-Signature=x#frag", "s3://bucket/a/b"),
        ("hf://org/name@rev", "hf://org/name@rev"),
        ("org/name@v1.0", "org/name@v1.0"),
        ("/local/path@x/model", "/local/path@x/model"),
        ("gs://bucket/path", "gs://bucket/path"),
    ],
)
def test_redact_location(location: str, expected: str) -> None:
    assert redact_location(location) == expected


def test_hub_repo_id() -> None:
    assert hub_repo_id("hf://models/org/name@main") == "org/name"
    assert hub_repo_id("./local") == "./local"
