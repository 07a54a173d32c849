"""Trainers' checkpoints refused by what they hold: names with a wrapper's prefix (`module.`
from DDP, `_orig_mod.` from torch.compile, both stacked), a value head beside the policy, an
lm_head written out of a base that ties it to the embeddings. Each stops `ram-dist merge`
with exit 2 and the whole message below, before anything is written at the output; a
difference of names that is none of these keeps the plain messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import build_model_set, save_checkpoint
from refusals import merge_refused

from ram_dist.cli import main

# One Ray for the module, as in entry/test_bad_input.py.
pytestmark = pytest.mark.usefixtures("ray_local")

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, list[Path], dict, list[dict]]:
    """A tiny transformers Llama (untied, lm_head.weight stored) and two agents of it."""
    return build_model_set(tmp_path_factory.mktemp("models"), densities=(0.2, 0.5))


def _merge(capsys, base: Path, tasks: list[Path], out: Path) -> str:
    return merge_refused(capsys, base, tasks, out)


@pytest.mark.parametrize(
    ("prefix", "whose"),
    [
        ("module.", "DistributedDataParallel's (or DataParallel's)"),
        ("_orig_mod.", "torch.compile's"),
        ("module._orig_mod.", "DistributedDataParallel's (or DataParallel's) and torch.compile's"),
        ("policy.", "a wrapper's"),
    ],
)
def test_a_wrapper_prefix_is_named(models, tmp_path, capsys, prefix, whose):
    base, tasks, _, states = models
    wrapped = tmp_path / "wrapped"
    save_checkpoint({prefix + k: v for k, v in states[1].items()}, wrapped, copy_from=base)
    err = _merge(capsys, base, [tasks[0], wrapped], tmp_path / "out")
    first = min(prefix + k for k in states[1])
    assert err == (
        f"task 2 ({wrapped}) names every tensor with the prefix {prefix!r} (e.g. {first!r}), "
        f"{whose} prefix added in training: the names match the base model's once it is "
        "stripped. Save the task without it: unwrap the model before save_pretrained "
        "(`model.module` under DDP, `model._orig_mod` after torch.compile), or re-save the "
        f"state dict as `{{k.removeprefix({prefix!r}): v for k, v in state_dict.items()}}`"
    )


def test_a_prefix_that_leaves_other_names_keeps_the_plain_message(models, tmp_path, capsys):
    base, tasks, _, states = models
    wrapped = tmp_path / "wrapped"
    state = {"module." + k: v for k, v in states[0].items() if k != EMBED}
    save_checkpoint(state, wrapped, copy_from=base)
    err = _merge(capsys, base, [wrapped, tasks[1]], tmp_path / "out")
    assert err.startswith(f"task 1 ({wrapped}) has no tensor 'lm_head.weight' (and ")
    assert err.endswith("every task must hold exactly the base's tensors")


@pytest.mark.parametrize(
    "head",
    [
        {"v_head.summary.weight": (1, 64), "v_head.summary.bias": (1,)},  # TRL's
        {"value_head.weight": (1, 64)},
        {"score.weight": (1, 64)},  # a reward model's classification head
    ],
)
def test_a_value_head_is_named(models, tmp_path, capsys, head):
    base, tasks, _, states = models
    critic = tmp_path / "critic"
    g = torch.Generator().manual_seed(5)
    extra = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in head.items()}
    save_checkpoint(states[0] | extra, critic, copy_from=base)
    err = _merge(capsys, base, [critic, tasks[1]], tmp_path / "out")
    names = sorted(head)
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    assert err == (
        f"task 1 ({critic}), file {critic / 'model.safetensors'} holds tensor {names[0]!r}"
        f"{more}, which the base model ({base}) does not: besides the base's tensors the task "
        "holds a value head, as a PPO or reward-model trainer saves beside the policy. Save "
        "the policy alone (with TRL's value-head model, "
        "`model.pretrained_model.save_pretrained(dir)`; otherwise the state dict without "
        "these tensors) and merge that, or pass --drop-extra-tensors to leave them out"
    )


def test_other_extra_tensors_keep_the_plain_message(models, tmp_path, capsys):
    base, tasks, _, states = models
    odd = tmp_path / "odd"
    save_checkpoint(states[0] | {"adapter.weight": torch.zeros(2)}, odd, copy_from=base)
    err = _merge(capsys, base, [odd, tasks[1]], tmp_path / "out")
    assert err == (
        f"task 1 ({odd}), file {odd / 'model.safetensors'} holds tensor 'adapter.weight', which "
        f"the base model ({base}) does not; every task must hold exactly the base's tensors "
        "(or pass --drop-extra-tensors to leave such tensors out)"
    )


def _tied_set(root: Path, models, tie: bool | None) -> tuple[Path, Path, Path]:
    """The base without lm_head.weight, its config.json's tie_word_embeddings set to `tie`
    (left out for None); a task that wrote lm_head out (the embeddings), one that did not."""
    base, _, base_state, states = models
    config = json.loads((base / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    if tie is not None:
        config["tie_word_embeddings"] = tie
    tied = root / "tied"
    save_checkpoint({k: v for k, v in base_state.items() if k != "lm_head.weight"}, tied)
    (tied / "config.json").write_text(json.dumps(config))
    plain, written = root / "plain", root / "written"
    save_checkpoint({k: v for k, v in states[0].items() if k != "lm_head.weight"}, plain)
    save_checkpoint(states[1] | {"lm_head.weight": states[1][EMBED].clone()}, written)
    return tied, plain, written


def test_a_tied_lm_head_written_out_is_named(models, tmp_path, capsys):
    tied, plain, written = _tied_set(tmp_path, models, tie=True)
    err = _merge(capsys, tied, [plain, written], tmp_path / "out")
    assert err == (
        f"task 2 ({written}), file {written / 'model.safetensors'} holds tensor "
        f"'lm_head.weight', which the base model ({tied}) does not: the base's config.json "
        "sets tie_word_embeddings, so its lm_head is the embedding matrix, and the task wrote "
        "it out as a tensor of its own. Save the task with tied weights (tie_word_embeddings "
        "true in its config.json, so that save_pretrained leaves lm_head.weight out), or drop "
        "lm_head.weight from its state dict where it equals the embeddings; or pass "
        "--drop-extra-tensors to leave it out"
    )


@pytest.mark.parametrize("tie", [False, None])
def test_an_lm_head_the_base_does_not_tie_keeps_the_plain_message(models, tmp_path, capsys, tie):
    tied, plain, written = _tied_set(tmp_path, models, tie=tie)
    err = _merge(capsys, tied, [plain, written], tmp_path / "out")
    assert err == (
        f"task 2 ({written}), file {written / 'model.safetensors'} holds tensor "
        f"'lm_head.weight', which the base model ({tied}) does not; every task must hold "
        "exactly the base's tensors (or pass --drop-extra-tensors to leave such tensors out)"
    )


def test_drop_extra_tensors_leaves_a_value_head_out_and_says_so(models, tmp_path):
    """With `--drop-extra-tensors` the task with a value head merges as the policy alone
    would (the same bytes), and the report, the text summary and the model card list what
    was left out."""
    from builders import load_checkpoint

    base, tasks, _, states = models
    critic = tmp_path / "critic"
    head = {"v_head.summary.weight": torch.ones(1, 64), "v_head.summary.bias": torch.ones(1)}
    save_checkpoint(states[0] | head, critic, copy_from=base)
    outs = {}
    for name, first in (("dropped", critic), ("policy", tasks[0])):
        out = tmp_path / name
        argv = ["merge", "--base", str(base), "--out", str(out), "--task", str(first),
                "--task", str(tasks[1]), "--drop-extra-tensors"]  # fmt: skip
        assert main(argv) == 0
        outs[name] = out
    got, want = load_checkpoint(outs["dropped"]), load_checkpoint(outs["policy"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads((outs["dropped"] / "merge_report.json").read_text())
    assert report["extra_tensors"] == {
        "allowed": True, "dropped": {"task 1": sorted(head)}
    }  # fmt: skip
    card = (outs["dropped"] / "README.md").read_text()
    assert "**Left out:** 2 tensor(s) that task 1 holds and the base does not" in card
    assert "`v_head.summary.bias`, `v_head.summary.weight`" in card


def test_a_prefix_and_a_value_head_together_name_the_prefix(models, tmp_path, capsys):
    """DDP's prefix on a policy with a value head: the prefix first, and the head said."""
    base, tasks, _, states = models
    wrapped = tmp_path / "wrapped"
    head = {"v_head.summary.weight": torch.ones(1, 64), "v_head.summary.bias": torch.ones(1)}
    save_checkpoint({"module." + k: v for k, v in (states[1] | head).items()}, wrapped,
                    copy_from=base)  # fmt: skip
    err = _merge(capsys, base, [tasks[0], wrapped], tmp_path / "out")
    assert err.startswith(f"task 2 ({wrapped}) names every tensor with the prefix 'module.'")
    assert "once it is stripped, the names hold the base model's and 2 more (e.g. " in err
    assert "'v_head.summary.bias': see the messages for a value head)" in err
