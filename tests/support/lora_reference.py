"""The spec's rule for a PEFT LoRA adapter as a task, as an independent oracle.

Written from `../shared/spec/ram.md`, section "LoRA and PEFT adapters as tasks", with plain
torch on whole tensors, to be read against it line by line; it never imports ram_dist (nor
PEFT: the adapter's files are read here, and PEFT's one rule we follow, the matching of
`rank_pattern` / `alpha_pattern` keys, is copied from `peft.utils.other.get_pattern_key`).

`adapter_task_state(base, adapter_dir)` is the task's full state: every base tensor, those
the adapter does not touch equal to the base. `materialize` writes it as a full checkpoint
folder, to be given to ram-dist as an ordinary task. An FP8 base's weights are dequantized by
`fp8_reference.dequantize` (the spec's FP8 rule, also independent of ram_dist) and rounded to
bf16, the adapter's precision there (`reference.base_at`), before the delta is added.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch
from fp8_reference import FP8, SCALE, dequantize
from reference import base_at
from safetensors.torch import load_file, save_file

State = dict[str, torch.Tensor]
PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# The saved key's ending -> (its role, the base tensor's ending it names). Spec: "Names".
_ROLES = (
    (".lora_A.weight", "A", ".weight"),
    (".lora_B.weight", "B", ".weight"),
    (".lora_B.bias", "B_bias", ".bias"),
    (".lora_embedding_A", "emb_A", ".weight"),
    (".lora_embedding_B", "emb_B", ".weight"),
    (".base_layer.weight", "base_layer", ".weight"),
)


class AdapterRefused(ValueError):
    """An adapter the spec refuses (the reference's own refusal, not ram-dist's)."""


def get_pattern_key(pattern_keys, key_to_match: str) -> str:
    """PEFT's matching rule (peft.utils.other.get_pattern_key, PEFT 0.21): the first pattern
    key, in the config's order, with `re.match(rf"(.*\\.)?({key})$", module_name)`; else the
    module's own name (which then is in no pattern, so the defaults apply)."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", key_to_match):
            return key
    return key_to_match


def read_adapter(adapter_dir: str | os.PathLike) -> tuple[dict, State]:
    """The adapter's config and tensors; refuses what the spec refuses before any work."""
    folder = Path(adapter_dir)
    config = json.loads((folder / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise AdapterRefused(f"{folder}: use_dora")
    if not (folder / WEIGHTS).is_file():
        raise AdapterRefused(f"{folder}: no {WEIGHTS} (a pickle is never opened)")
    return config, load_file(str(folder / WEIGHTS))


def module_scale(config: dict, module: str) -> tuple[int, float, float]:
    """(r, lora_alpha, s) for `module` (its name in the model, e.g.
    `model.layers.0.self_attn.q_proj`). Spec: "Scale": `s = lora_alpha / r`, or
    `lora_alpha / sqrt(r)` with `use_rslora`, with the module's own r and alpha where
    rank_pattern / alpha_pattern has a key that matches it; computed in float64 (a Python
    float) and rounded to float32 once (returned as that float32's value)."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), config["r"])
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config["lora_alpha"])
    s64 = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    s32 = float(torch.tensor(s64, dtype=torch.float64).to(torch.float32))
    return r, alpha, s32


def fixed_order_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Spec: "Product": `P[i,j] = sum_k float32(B[i,k]) * float32(A[k,j])`, k ascending, the
    sum starting from the k = 0 product, each product and each addition rounded to nearest
    even, no fused multiply-add. Separate float32 torch ops on CPU: each rounds on its own."""
    b, a = b.to(torch.float32), a.to(torch.float32)
    r = b.shape[1]
    assert a.shape[0] == r, (tuple(b.shape), tuple(a.shape))
    acc = b[:, 0:1] * a[0:1, :]
    for k in range(1, r):
        acc = acc + b[:, k : k + 1] * a[k : k + 1, :]
    return acc


def _split_keys(config: dict, tensors: State) -> tuple[dict[str, dict], State]:
    """({module: {role: tensor}}, {base tensor name: modules_to_save value})."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    saved: State = {}
    keep = tuple(config.get("modules_to_save") or ())
    for key, value in tensors.items():
        if not key.startswith(PREFIX):
            raise AdapterRefused(f"key {key!r} does not start with {PREFIX!r}")
        name = key[len(PREFIX) :]
        for ending, role, _ in _ROLES:
            if name.endswith(ending):
                modules.setdefault(name[: -len(ending)], {})[role] = value
                break
        else:
            # A modules_to_save copy, under the module's plain key (PEFT matches a module
            # by `module_name.endswith(entry)`).
            module = name.rsplit(".", 1)[0]
            if not any(module.endswith(entry) for entry in keep):
                raise AdapterRefused(f"key {key!r} is neither a LoRA factor nor in modules_to_save")
            saved[name] = value
    return modules, saved


def _delta(config: dict, module: str, parts: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """`delta = float32(s) * P`, in the base tensor's shape."""
    r, _, s = module_scale(config, module)
    if "emb_A" in parts:
        # An embedding: lora_embedding_A [r, num_embeddings], lora_embedding_B [dim, r];
        # delta = transpose(B @ A) * s, B @ A by the same fixed-order rule.
        b, a = parts["emb_B"], parts["emb_A"]
        assert a.shape[0] == r, (module, tuple(a.shape), r)
        delta = (torch.tensor(s, dtype=torch.float32) * fixed_order_product(b, a)).T
    else:
        b, a = parts["B"], parts["A"]
        assert a.shape[0] == r, (module, tuple(a.shape), r)
        delta = torch.tensor(s, dtype=torch.float32) * fixed_order_product(b, a)
        if config.get("fan_in_fan_out"):
            delta = delta.T  # transposed to W's shape ([in, out] for a Conv1D)
    if tuple(delta.shape) != tuple(shape):
        raise AdapterRefused(f"{module}: delta {tuple(delta.shape)} does not fit {tuple(shape)}")
    return delta.contiguous()


def adapter_deltas(base: State, adapter_dir: str | os.PathLike) -> tuple[State, State, State]:
    """What the adapter does to each base tensor it names, before any rounding to the base:
    (deltas, starts, outright).

    - deltas: {base tensor name: float32 delta} for every `<module>.weight` with a LoRA pair
      (`float32(s) * P`, in the tensor's shape) and every `<module>.bias` with a
      `lora_B.bias` (`float32(s) * float32(lora_B.bias)`);
    - starts: {`<module>.weight`: the adapter's `<module>.base_layer.weight`}, the value of
      that base tensor for this task before the delta is added;
    - outright: {name: the modules_to_save copy}, the task's value of that tensor.
    """
    config, tensors = read_adapter(adapter_dir)
    modules, outright = _split_keys(config, tensors)
    for name, value in outright.items():
        if name not in base:
            raise AdapterRefused(f"modules_to_save {name!r} names no base tensor")
        if value.shape != base[name].shape:
            raise AdapterRefused(f"modules_to_save {name!r}: shape {tuple(value.shape)}")
    deltas: State = {}
    starts: State = {}
    for module, parts in sorted(modules.items()):
        weight = module + ".weight"
        if weight not in base:
            raise AdapterRefused(f"{module}: names no base tensor {weight!r}")
        if "base_layer" in parts:
            if parts["base_layer"].shape != base[weight].shape:
                raise AdapterRefused(f"{module}: base_layer.weight shape differs (resized?)")
            starts[weight] = parts["base_layer"]
        if set(parts) & {"A", "B", "emb_A", "emb_B"}:
            deltas[weight] = _delta(config, module, parts, base[weight].shape)
        if "B_bias" in parts:
            bias = module + ".bias"
            if bias not in base:
                raise AdapterRefused(f"{module}: lora_B.bias but the base has no {bias!r}")
            _, _, s = module_scale(config, module)
            s32 = torch.tensor(s, dtype=torch.float32)
            deltas[bias] = s32 * parts["B_bias"].to(torch.float32)
    return deltas, starts, outright


def adapter_task_state(
    base: State, adapter_dir: str | os.PathLike, fp8_block: tuple[int, int] | None = None
) -> State:
    """The task's full state: the base with the adapter merged in, in the base's dtypes.

    Spec: "The task's value": `theta_t = cast(float32(theta_B^t) + delta, p_t)` (RNE), where
    the adapter's precision `p_t` is the base tensor's dtype (then `theta_B^t` is the base's
    value), or bfloat16 for an FP8 base weight (then `theta_B^t = cast(x_B, bf16)`, `x_B` its
    dequantized value: PEFT trains on the base as loaded in bf16); `bias_t =
    cast(float32(bias_B) + float32(s) * float32(lora_B.bias), dtype)`; a modules_to_save
    tensor is the task's value outright; `<module>.base_layer.weight` is the value of that
    base tensor before the delta is added; an untouched tensor is the base's. An adapted FP8
    weight (with `fp8_block`, the base's block size) is stored here as its bf16 tensor,
    without its `_scale_inv` companion; an FP8 weight the adapter does not touch stays the
    base's FP8 bytes and scale.
    """
    deltas, starts, outright = adapter_deltas(base, adapter_dir)
    out: State = dict(base)
    for name, value in starts.items():
        if base[name].dtype == FP8:
            raise AdapterRefused(f"{name}: a base_layer.weight for an FP8 weight")
        out[name] = value.to(base[name].dtype)
    for name, delta in deltas.items():
        if base[name].dtype == FP8:
            if fp8_block is None:
                raise ValueError(f"{name} is FP8: give the base's block size")
            x_b = dequantize(base[name], base[name + SCALE], fp8_block)  # float32
            theta_b = base_at(x_b, torch.bfloat16)  # the base as PEFT loads it: bf16
            out[name] = (theta_b.to(torch.float32) + delta).to(torch.bfloat16)
            del out[name + SCALE]
        else:
            out[name] = (out[name].to(torch.float32) + delta).to(base[name].dtype)
    for name, value in outright.items():
        out[name] = value.clone()
    return out


def fp8_block_of(folder: str | os.PathLike) -> tuple[int, int] | None:
    """The block size a checkpoint's config.json declares for fine-grained FP8, if any."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return None
    quant = json.loads(config_file.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    bm, bn = quant["weight_block_size"]
    return (bm, bn)


def load_state(folder: str | os.PathLike) -> State:
    """Every tensor of every *.safetensors file of a checkpoint folder."""
    state: State = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def materialize(
    base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike
) -> State:
    """Write the task's state as a full checkpoint folder: one `model.safetensors`, the base's
    `config.json` (and its other non-tensor files). Returns the state written. On an FP8
    base the folder mixes the untouched FP8 weights (with their scales) and the adapted bf16
    ones, under the base's `quantization_config`."""
    state = adapter_task_state(load_state(base_dir), adapter_dir, fp8_block_of(base_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    for f in Path(base_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return state
