"""A PEFT LoRA adapter as a task (`docs/inputs.md`): which base tensor each saved key
changes, and this task's source of every base tensor.

An adapter task stands for the base with the adapter merged in and saved in the base's
dtype; from there on it is a task like any other. Nothing is materialised: a tensor the
adapter changes gets a `LoraSource` (the workers compute its rows' values from the base's
and the adapter's factors), one it replaces outright (`modules_to_save`, trained biases) a
plain source into the adapter's file, and one it leaves alone `BaseValues`: the workers
read it once, for the base. Everything here works on the adapter's config and header,
on the driver, before any tensor byte is read; what cannot be merged exactly is refused,
naming the folder, the key and what to do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ram_dist.dtypes import FLOATING
from ram_dist.errors import CheckpointError
from ram_dist.io.checkpoint import Checkpoint
from ram_dist.io.safetensors_header import TensorInfo
from ram_dist.planning.lora_sources import LoraBiasSource, LoraSource
from ram_dist.planning.sources import BaseValues, Source, TensorSource

#: What PEFT puts before every module name it saves.
PREFIX = "base_model.model."
#: The dtype a LoRA task's value of an FP8 base weight is rounded to.
FP8_TASK_DTYPE = "BF16"
#: Config keys that, when set, make an adapter something a plain LoRA merge is not: its
#: value in words, for the refusal.
VARIANTS = {
    "use_dora": "DoRA (use_dora: true)",
    "use_qalora": "QALoRA (use_qalora: true)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
}
#: Key endings of the factors, by what they are.
_PARTS = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_embedding_A": "embedding_A",
    ".lora_embedding_B": "embedding_B",
    ".lora_B.bias": "bias",
    ".base_layer.weight": "base_weight",
    ".base_layer.bias": "base_bias",
}
MERGE_FIRST = (
    "merge it into the base with PEFT (`PeftModel.from_pretrained(base, adapter)"
    ".merge_and_unload().save_pretrained(dir)`) and give that folder as the task"
)


@dataclass(frozen=True)
class LoraConfig:
    """What of `adapter_config.json` decides the values (PEFT's meanings)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    fan_in_fan_out: bool
    target_modules: tuple[str, ...]
    modules_to_save: tuple[str, ...]
    lora_bias: bool

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """The module's own r and its scale `lora_alpha / r` (`/ sqrt(r)` with rslora),
        computed in float64 and rounded to float32 once. A pattern's key matches the module
        as PEFT's `get_pattern_key` does: the first key, in the config's order, that equals
        the name's end after a dot."""
        r = self.r
        for key, value in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                r = value
                break
        alpha = self.lora_alpha
        for key, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                alpha = value
                break
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, float(np.float32(scale))

    def describe(self) -> str:
        """In words, for `plan`, the report, the model card and `probe`."""
        words = [f"r={self.r}", f"lora_alpha={_number(self.lora_alpha)}"]
        if self.use_rslora:
            words.append("rslora")
        if self.rank_pattern:
            words.append(f"rank_pattern={self.rank_pattern}")
        if self.alpha_pattern:
            words.append(f"alpha_pattern={self.alpha_pattern}")
        if self.fan_in_fan_out:
            words.append("fan_in_fan_out")
        if self.lora_bias:
            words.append("lora_bias")
        words.append("target_modules=" + ",".join(sorted(self.target_modules)))
        if self.modules_to_save:
            words.append("modules_to_save=" + ",".join(self.modules_to_save))
        return "PEFT LoRA adapter (" + ", ".join(words) + ")"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def lora_config(adapter: Checkpoint) -> LoraConfig:
    """The adapter's config, or a `CheckpointError` naming the folder and what it holds."""
    raw = adapter.adapter
    assert raw is not None
    where = f"{adapter.label} ({adapter.url})"
    kind = raw.get("peft_type")
    if kind != "LORA":
        raise CheckpointError(
            f"{where} is a PEFT {kind} adapter (peft_type in adapter_config.json): ram-dist "
            f"merges LoRA adapters only; {MERGE_FIRST}"
        )
    for key, words in VARIANTS.items():
        if raw.get(key):
            raise CheckpointError(
                f"{where} is a LoRA adapter with {words}, whose merge is not a plain LoRA "
                f"product: ram-dist does not merge it; {MERGE_FIRST}"
            )
    r = raw.get("r")
    alpha = raw.get("lora_alpha", 8)
    ranks = raw.get("rank_pattern") or {}
    alphas = raw.get("alpha_pattern") or {}
    if (
        not _positive_int(r)
        or not _positive_number(alpha)
        or not isinstance(ranks, dict)
        or not (
            isinstance(alphas, dict)
            and all(_positive_int(v) for v in ranks.values())
            and all(_positive_number(v) for v in alphas.values())
        )
    ):
        raise CheckpointError(
            f"{where}: adapter_config.json has r {r!r}, lora_alpha {alpha!r}, rank_pattern "
            f"{ranks!r}, alpha_pattern {alphas!r}: r and ranks must be positive integers, "
            "alphas positive numbers; save the adapter with PEFT's `save_pretrained`"
        )
    targets = raw.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(map(str, targets))
    saved = tuple(map(str, raw.get("modules_to_save") or ()))
    return LoraConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=raw.get("use_rslora") is True,
        rank_pattern=dict(ranks),
        alpha_pattern={k: float(v) for k, v in alphas.items()},
        fan_in_fan_out=raw.get("fan_in_fan_out") is True,
        target_modules=targets,
        modules_to_save=saved,
        lora_bias=raw.get("lora_bias") is True,
    )


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _positive_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


@dataclass
class _Module:
    """The keys an adapter saved for one module, by part (`_PARTS`)."""

    name: str
    parts: dict[str, TensorInfo]


def adapter_sources(
    base: Checkpoint,
    view: Mapping[str, TensorInfo],
    base_sources: Mapping[str, TensorSource],
    adapter: Checkpoint,
    config: LoraConfig,
) -> dict[str, TensorSource]:
    """This task's source of every base tensor (`base_sources`, by name; companions left
    out): a LoRA product, the adapter's own copy, or the base's source itself. `view`: the
    base's tensors as the merge sees them (`Format.view`: a packed INT weight under its
    decoded name and shape), which the adapter's keys and shapes are checked against."""
    where = f"{adapter.label} ({adapter.url})"
    modules: dict[str, _Module] = {}
    outright: dict[str, TensorInfo] = {}
    for key, info in sorted(adapter.tensors.items()):
        rest = key[len(PREFIX) :] if key.startswith(PREFIX) else None
        part = next((p for end, p in _PARTS.items() if rest and rest.endswith(end)), None)
        if rest is not None and part is not None:
            end = next(e for e, p in _PARTS.items() if p == part)
            module = rest[: -len(end)]
            modules.setdefault(module, _Module(module, {})).parts[part] = info
        elif rest is not None and rest in base_sources:
            outright[rest] = info
        else:
            raise CheckpointError(_no_base_tensor(where, base, key, rest))
    sources: dict[str, TensorSource] = {
        name: BaseValues(src.values_dtype) for name, src in base_sources.items()
    }
    for name, info in outright.items():
        _check_shape(where, base, name, info, view[name].shape)
        sources[name] = Source(info.file, info.start, info.dtype)
    for module in modules.values():
        sources.update(_module_sources(where, base, view, base_sources, module, config))
    return sources


def _no_base_tensor(where: str, base: Checkpoint, key: str, rest: str | None) -> str:
    if rest is not None and rest.endswith(".lora_magnitude_vector"):
        return (
            f"{where} holds {key!r}, a DoRA magnitude: ram-dist does not merge DoRA "
            f"adapters; {MERGE_FIRST}"
        )
    name = rest if rest is not None else key
    return (
        f"{where} holds {key!r}, which names no tensor of the {base.label} ({base.url}) "
        f"(looked for {name!r}): the adapter was trained on another model, or saved by "
        f"another tool; give the base it was trained on, or {MERGE_FIRST}"
    )


def _check_shape(
    where: str, base: Checkpoint, name: str, info: TensorInfo, want: tuple[int, ...]
) -> None:
    if info.shape != want:
        raise CheckpointError(
            f"{where} holds {info.name!r} of shape {list(info.shape)} (file {info.file}), "
            f"which does not fit {name!r} of shape {list(want)} in the {base.label} "
            f"({base.url}): the adapter was trained on another model (or a resized vocabulary)"
        )
    if info.dtype not in FLOATING:
        raise CheckpointError(
            f"{where} holds {info.name!r} as {info.dtype}: adapter tensors are floating point"
        )


def _module_sources(
    where: str,
    base: Checkpoint,
    view: Mapping[str, TensorInfo],
    base_sources: Mapping[str, TensorSource],
    module: _Module,
    config: LoraConfig,
) -> dict[str, TensorSource]:
    """The sources of one module's weight (and bias) that the adapter changes."""
    parts = module.parts
    weight, bias = module.name + ".weight", module.name + ".bias"
    out: dict[str, TensorSource] = {}
    embedding = "embedding_A" in parts or "embedding_B" in parts
    a = parts.get("embedding_A" if embedding else "A")
    b = parts.get("embedding_B" if embedding else "B")
    if (a is None) != (b is None):
        have = next(p for p in (a, b) if p is not None)
        raise CheckpointError(
            f"{where} holds {have.name!r} without its other LoRA factor: the adapter file is "
            "incomplete; save it again with PEFT's `save_pretrained`"
        )
    r, scale = config.rank_and_scale(module.name)
    if a is not None and b is not None:
        if weight not in base_sources:
            raise CheckpointError(_no_base_tensor(where, base, a.name, weight))
        shape = view[weight].shape
        if len(shape) != 2:
            raise CheckpointError(
                f"{where} holds LoRA factors for {weight!r}, whose shape in the {base.label} "
                f"is {list(shape)}: LoRA is merged into matrices only"
            )
        transposed = embedding or config.fan_in_fan_out
        rows, cols = shape
        # A [r, in] and B [out, r]: in, out are the weight's columns, rows unless transposed
        fan_in, fan_out = (rows, cols) if transposed else (cols, rows)
        _check_shape(where, base, weight, a, (r, fan_in))
        _check_shape(where, base, weight, b, (fan_out, r))
        theta = _theta(where, base, view, weight, parts.get("base_weight"))
        out[weight] = LoraSource(
            b.file, b.start, b.dtype, a.start, a.dtype, r, rows, cols, scale, transposed,
            *_dtypes(base_sources[weight], theta),
            theta,
        )  # fmt: skip
    elif "base_weight" in parts:
        info = parts["base_weight"]
        _check_shape(where, base, weight, info, view[weight].shape)
        out[weight] = Source(info.file, info.start, info.dtype)
    if "bias" in parts:
        lb = parts["bias"]
        if bias not in base_sources:
            raise CheckpointError(
                f"{where} holds {lb.name!r} (lora_bias), but the {base.label}'s module "
                f"{module.name!r} has no bias ({bias!r}), so the bias cannot be merged (PEFT "
                "refuses to merge it too); train the adapter without lora_bias for this module"
            )
        _check_shape(where, base, bias, lb, view[bias].shape)
        theta = _theta(where, base, view, bias, parts.get("base_bias"))
        out[bias] = LoraBiasSource(
            lb.file, lb.start, lb.dtype, scale, *_dtypes(base_sources[bias], theta), theta
        )
    elif "base_bias" in parts:
        info = parts["base_bias"]
        _check_shape(where, base, bias, info, view[bias].shape)
        out[bias] = Source(info.file, info.start, info.dtype)
    return out


def _theta(
    where: str, base: Checkpoint, view: Mapping[str, TensorInfo], name: str, info: TensorInfo | None
) -> Source | None:
    """The adapter's own copy of base tensor `name` (`base_layer`), checked; None if none."""
    if info is None:
        return None
    _check_shape(where, base, name, info, view[name].shape)
    return Source(info.file, info.start, info.dtype)


def _dtypes(base: TensorSource, theta: Source | None) -> tuple[str, str]:
    """(the dtype of the base values a LoRA source adds to, the task's dtype): the adapter's
    copy's, or the base's; bfloat16 for an FP8 base weight (its values are float32)."""
    if theta is not None:
        return theta.dtype, theta.dtype
    if base.decoded:
        return base.values_dtype, FP8_TASK_DTYPE
    return base.values_dtype, base.values_dtype


#: config.json keys whose values say which model an adapter was trained on: the
#: architecture and its sizes (Llama/Qwen-style names, and GPT-2's).
MODEL_KEYS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "vocab_size", "n_embd", "n_layer", "n_head",
)  # fmt: skip


def check_trained_on(
    adapter: Checkpoint, trained_on: dict[str, Any] | None, base: Checkpoint
) -> None:
    """Refuse an adapter whose `base_model_name_or_path` is clearly another model: its
    config.json (`trained_on`, where it could be read) differs from the base's in the
    architecture or its sizes."""
    if trained_on is None or base.model_config is None:
        return
    differ = [
        k for k in MODEL_KEYS
        if k in trained_on and k in base.model_config and trained_on[k] != base.model_config[k]
    ]  # fmt: skip
    if differ:
        named = (adapter.adapter or {}).get("base_model_name_or_path")
        what = ", ".join(
            f"{k} {trained_on[k]!r} there, {base.model_config[k]!r} in the base" for k in differ
        )
        raise CheckpointError(
            f"{adapter.label} ({adapter.url}) was trained on {named!r} (base_model_name_or_path "
            f"in adapter_config.json), another model than the {base.label} ({base.url}): "
            f"{what}; give the base it was trained on"
        )
