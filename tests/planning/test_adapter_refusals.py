"""Adapters that cannot be merged exactly are refused before any work (issue 33, point 3):
each stops `ram-dist merge` with exit 2, a message naming the adapter folder, what it holds
and what to do, and nothing at the output. The adapters are written by PEFT itself
(`support/peft_adapters.py`); the broken ones are PEFT's files edited as a user's tool might
leave them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import build_tiny_base
from peft_adapters import (
    build_adapter,
    build_dora_adapter,
    build_loha_adapter,
    build_pickle_adapter,
)
from refusals import merge_refused
from safetensors.torch import load_file, save_file

from ram_dist.cli import main

pytestmark = pytest.mark.usefixtures("ray_local")

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    for kind in ("llama", "qwen2"):
        build_tiny_base(root / kind, kind=kind)
    return {"llama": root / "llama", "qwen2": root / "qwen2", "root": root}


@pytest.fixture(scope="module")
def good(bases) -> Path:
    return build_adapter(bases["llama"], bases["root"] / "good", target_modules=("q_proj",))


def _error(capsys, base: Path, tasks: list[Path], out: Path) -> str:
    """The error line of a merge of `tasks` (the refused one second, after a good one)."""
    return "ram-dist: error: " + merge_refused(capsys, base, tasks, out)


def _edited(good: Path, to: Path, tensors=None, config=None) -> Path:
    """A copy of adapter `good` with its tensors and config changed by the given functions."""
    to.mkdir()
    state = load_file(str(good / "adapter_model.safetensors"))
    save_file(tensors(state) if tensors else state, str(to / "adapter_model.safetensors"))
    cfg = json.loads((good / "adapter_config.json").read_text())
    (to / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    return to


def test_other_peft_types_are_refused(bases, good, tmp_path, capsys):
    loha = build_loha_adapter(bases["llama"], tmp_path / "loha")
    err = _error(capsys, bases["llama"], [good, loha], tmp_path / "out")
    assert f"task 2 ({loha}) is a PEFT LOHA adapter" in err
    assert "merges LoRA adapters only" in err and "merge_and_unload()" in err


def test_dora_is_refused(bases, good, tmp_path, capsys):
    dora = build_dora_adapter(bases["llama"], tmp_path / "dora")
    err = _error(capsys, bases["llama"], [good, dora], tmp_path / "out")
    assert f"task 2 ({dora}) is a LoRA adapter with DoRA (use_dora: true)" in err
    assert "merge_and_unload()" in err


def test_a_dora_magnitude_without_the_flag_is_refused(bases, good, tmp_path, capsys):
    """A config that lost its `use_dora` still holds the magnitudes: named by key."""
    dora = build_dora_adapter(bases["llama"], tmp_path / "dora")
    lying = _edited(dora, tmp_path / "lying", config=lambda c: {**c, "use_dora": False})
    err = _error(capsys, bases["llama"], [good, lying], tmp_path / "out")
    assert "lora_magnitude_vector" in err and "DoRA magnitude" in err


def test_a_pickle_only_adapter_is_refused_unopened(bases, good, tmp_path, capsys):
    pickled = build_pickle_adapter(bases["llama"], tmp_path / "pickled")
    assert (pickled / "adapter_model.bin").exists()
    err = _error(capsys, bases["llama"], [good, pickled], tmp_path / "out")
    assert f"task 2 ({pickled}) is a PEFT adapter folder with its weights only as " in err
    assert "adapter_model.bin, a pickle, which ram-dist never opens" in err


def test_a_key_that_names_no_base_tensor_is_refused(bases, good, tmp_path, capsys):
    moved = Q_A.replace("layers.0", "layers.7")
    renamed = _edited(good, tmp_path / "renamed", tensors=lambda s: {
        k.replace("layers.0.self_attn.q_proj", "layers.7.self_attn.q_proj"): v
        for k, v in s.items()})  # fmt: skip
    err = _error(capsys, bases["llama"], [good, renamed], tmp_path / "out")
    assert f"holds {moved!r}, which names no tensor of the base model" in err, err
    assert "'model.layers.7.self_attn.q_proj.weight'" in err


def test_a_shape_that_does_not_fit_is_refused(bases, good, tmp_path, capsys):
    import torch

    def widen(state: dict) -> dict:
        return {k: torch.zeros(4, 65) if k == Q_A else v for k, v in state.items()}

    wider = _edited(good, tmp_path / "wider", tensors=widen)
    err = _error(capsys, bases["llama"], [good, wider], tmp_path / "out")
    assert f"holds {Q_A!r} of shape [4, 65]" in err
    assert "does not fit 'model.layers.0.self_attn.q_proj.weight'" in err


def test_an_adapter_of_another_model_is_refused(bases, good, tmp_path, capsys):
    """Trained on the tiny Qwen2 (its base_model_name_or_path), given the tiny Llama."""
    qwen = build_adapter(bases["qwen2"], tmp_path / "qwen_adapter", target_modules=("q_proj",))
    err = _error(capsys, bases["llama"], [good, qwen], tmp_path / "out")
    assert f"was trained on {str(bases['qwen2'])!r}" in err
    assert "model_type 'qwen2' there, 'llama' in the base" in err


def test_lora_bias_on_a_layer_without_bias_is_refused(bases, good, tmp_path, capsys):
    biased = build_adapter(
        bases["llama"], tmp_path / "biased", target_modules=("q_proj",), lora_bias=True
    )
    err = _error(capsys, bases["llama"], [good, biased], tmp_path / "out")
    assert (
        "(lora_bias), but the base model's module 'model.layers.0.self_attn.q_proj' has no" in err
    )


def test_an_adapter_as_the_base_is_refused(bases, good, tmp_path, capsys):
    err = _error(capsys, good, [bases["llama"], bases["qwen2"]], tmp_path / "out")
    assert f"the base model ({good}) is a PEFT adapter folder" in err


def _yaml(tmp_path: Path, base: str, model: str) -> Path:
    path = tmp_path / "merge.yml"
    path.write_text(
        f"merge_method: ram_plus\nbase_model: {base}\nmodels:\n  - model: {model}\n"
        f"  - model: {model}x\n"
    )
    return path


def test_yaml_applies_an_adapter_to_the_base_model_only(bases, good, tmp_path, capsys):
    other = bases["qwen2"]
    config = _yaml(tmp_path, str(bases["llama"]), f"{other}+{good}")
    code = main(["merge", str(config), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "which is not the base_model" in err, err
    config = _yaml(tmp_path, f"{bases['llama']}+{good}", str(good))
    code = main(["merge", str(config), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "the base model is a model, not a model with an adapter" in err, err
