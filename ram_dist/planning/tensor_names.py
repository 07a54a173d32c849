"""Whether a task holds the base's tensors, as the merge sees them (`Format.view`), and, where
it does not, what a person can do: a trainer's checkpoint that wraps every name, holds a
value head beside the policy, or writes out the lm_head of a base that ties it to the
embeddings is named for what it is."""

from __future__ import annotations

from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo


def _more(names: list[str]) -> str:
    """What follows the first of several names an error cites: " (and N more)"."""
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def check_names(
    base: Checkpoint,
    base_view: dict[str, TensorInfo],
    task: Checkpoint,
    view: dict[str, TensorInfo],
    drop_extra: bool,
) -> tuple[str, ...]:
    """The same tensors as the merge sees them (`Format.view`: an FP8 weight's scales not
    counted as tensors of their own, an MXFP4 weight by its decoded name); with
    `drop_extra`, the task's tensors the base lacks are returned (left out), not refused."""
    base_names = set(base_view)
    task_names = set(view)
    if task_names == base_names:
        return ()
    if drop_extra and base_names < task_names:
        return tuple(sorted(task_names - base_names))
    _check_trainer_names(base, base_names, task, task_names)
    missing = sorted(base_names - task_names)
    if missing:
        raise CheckpointError(
            f"{task.label} ({task.url}) has no tensor {missing[0]!r}{_more(missing)}, which the "
            f"{base.describe(missing[0])} holds; every task must hold exactly the base's tensors"
        )
    extra = sorted(task_names - base_names)
    if extra:
        raise CheckpointError(
            f"{task.describe(extra[0])} holds tensor {extra[0]!r}{_more(extra)}, which the "
            f"{base.label} ({base.url}) does not; every task must hold exactly the base's tensors "
            f"(or pass {DROP_EXTRA} to leave such tensors out)"
        )
    return ()


#: The flag that leaves out a task's tensors the base lacks, as the messages name it.
DROP_EXTRA = "--drop-extra-tensors"
#: What a training wrapper adds before every name, by the wrapper's attribute.
WRAPPERS = {
    "module": "DistributedDataParallel's (or DataParallel's)",
    "_orig_mod": "torch.compile's",
}
#: Name parts of the head an RL or reward trainer saves beside the policy: TRL's value head
#: (`v_head.summary.*`), other trainers' `value_head`, `reward_head` or `critic`, and
#: transformers' sequence-classification head (`score`) of a reward model.
VALUE_HEAD_PARTS = frozenset({"v_head", "value_head", "reward_head", "critic", "score"})
#: The output projection a model with tied word embeddings shares with its input embedding.
LM_HEAD = "lm_head.weight"


def _check_trainer_names(
    base: Checkpoint, base_names: set[str], task: Checkpoint, task_names: set[str]
) -> None:
    """A task whose names differ from the base's the way a trainer's checkpoint does, named
    for what it holds and what to do: every name with a wrapper's prefix, a value head beside
    the base's tensors, or the lm_head written out of a base that ties it to the embeddings.
    Any other difference is left to `_check_names`'s own messages."""
    prefix = _common_prefix(base_names, task_names)
    if prefix is not None:
        first = min(task_names)
        parts = prefix.rstrip(".").split(".")
        whose = (
            " and ".join(WRAPPERS[p] for p in parts) if all(p in WRAPPERS for p in parts)
            else "a wrapper's"
        )  # fmt: skip
        stripped = {n[len(prefix) :] for n in task_names}
        extra = sorted(stripped - base_names)
        match = (
            f"the names match the {base.label}'s once it is stripped" if not extra
            else f"once it is stripped, the names hold the {base.label}'s and {len(extra)} more "
            f"(e.g. {extra[0]!r}: see the messages for a value head)"
        )  # fmt: skip
        raise CheckpointError(
            f"{task.label} ({task.url}) names every tensor with the prefix {prefix!r} (e.g. "
            f"{first!r}), {whose} prefix added in training: {match}. Save the task without "
            f"it: unwrap the model before "
            f"save_pretrained (`model.module` under DDP, `model._orig_mod` after torch.compile), "
            f"or re-save the state dict as `{{k.removeprefix({prefix!r}): v for k, v in "
            f"state_dict.items()}}`"
        )
    if not base_names <= task_names:
        return
    extra = sorted(task_names - base_names)
    said = (
        f"{task.describe(extra[0])} holds tensor {extra[0]!r}{_more(extra)}, which the "
        f"{base.label} ({base.url}) does not"
    )
    if extra == [LM_HEAD] and base.ties_embeddings:
        raise CheckpointError(
            f"{said}: the base's config.json sets tie_word_embeddings, so its lm_head is the "
            f"embedding matrix, and the task wrote it out as a tensor of its own. Save the task "
            f"with tied weights (tie_word_embeddings true in its config.json, so that "
            f"save_pretrained leaves {LM_HEAD} out), or drop {LM_HEAD} from its state dict "
            f"where it equals the embeddings; or pass {DROP_EXTRA} to leave it out"
        )
    if all(VALUE_HEAD_PARTS & set(n.split(".")) for n in extra):
        raise CheckpointError(
            f"{said}: besides the base's tensors the task holds a value head, as a PPO or "
            f"reward-model trainer saves beside the policy. Save the policy alone (with TRL's "
            f"value-head model, `model.pretrained_model.save_pretrained(dir)`; otherwise the "
            f"state dict without these tensors) and merge that, or pass {DROP_EXTRA} to leave "
            f"them out"
        )


def _common_prefix(base_names: set[str], task_names: set[str]) -> str | None:
    """The one dotted prefix (`module.`, `_orig_mod.`, `module._orig_mod.`, ...) that every
    task name carries, where the names hold every base name once it is stripped (and maybe
    more: a value head); None where there is none."""
    if not task_names or len(task_names) < len(base_names):
        return None
    parts = min(task_names).split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k]) + "."
        if not all(n.startswith(prefix) for n in task_names):
            break
        if base_names <= {n[len(prefix) :] for n in task_names}:
            return prefix
    return None
