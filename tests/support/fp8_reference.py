"""FP8 block-quantized checkpoints for the tests, and the spec's FP8 rules as an oracle.

Written from `../shared/spec/ram.md` ("FP8 block-quantized checkpoints") with plain torch on
whole tensors; it never imports ram_dist. The e4m3fn rounding is torch's own cast (round to
nearest even) after a clamp to +-448, which is the spec's saturation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from reference import reference_merge
from safetensors.torch import save_file

State = dict[str, torch.Tensor]
SCALE = "_scale_inv"
FP8 = torch.float8_e4m3fn


def expand(s: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """One value per element from one per block (ragged at the right and bottom edges)."""
    bm, bn = block
    return s.repeat_interleave(bm, 0)[: shape[0]].repeat_interleave(bn, 1)[:, : shape[1]]


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x[i, j] = float32(W[i, j]) * float32(S[i // bm, j // bn]): one float32 multiply."""
    return q.to(torch.float32) * expand(s.to(torch.float32), tuple(q.shape), block)


def e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value, ties to even, saturated to +-448."""
    return x.clamp(-448.0, 448.0).to(FP8)


def block_view(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[bands, blocks, bm, bn] of a matrix padded with zeros to whole blocks."""
    bm, bn = block
    r, c = x.shape
    pr, pc = math.ceil(r / bm) * bm, math.ceil(c / bn) * bn
    padded = torch.zeros((pr, pc), dtype=x.dtype)
    padded[:r, :c] = x
    return padded.reshape(pr // bm, bm, pc // bn, bn).permute(0, 2, 1, 3)


def quantize(
    x: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh per-block scales `amax / 448` (1 where amax is 0), stored in `scale_dtype`, and
    `e4m3fn(x / stored scale)`."""
    amax = block_view(x.abs(), block).amax(dim=(2, 3))
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0).to(scale_dtype)
    return e4m3fn(x / expand(s.to(torch.float32), tuple(x.shape), block)), s


def requantize(
    y: torch.Tensor, base_q: torch.Tensor, base_s: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's FP8 output: blocks whose `y` is the base's value bit for bit keep the
    base's bytes and scale; every other block is quantized afresh."""
    base_x = dequantize(base_q, base_s, block)
    same = y.view(torch.int32) == base_x.view(torch.int32)
    unchanged = block_view(same.to(torch.int8), block).amin(dim=(2, 3)).bool()
    # Padding must not count as changed: it is zero in both, so compare the real elements.
    q, s = quantize(y, block, base_s.dtype)
    s = torch.where(unchanged, base_s, s)
    keep = expand(unchanged, tuple(y.shape), block)
    q = torch.where(keep, base_q.view(torch.uint8), q.view(torch.uint8)).view(FP8)
    return q, s


def values(stored: State, block: tuple[int, int]) -> State:
    """A checkpoint's tensors as the merge sees them: FP8 weights dequantized (their value,
    float32: the precision "decoded"), scales gone, plain tensors as stored."""
    out: State = {}
    for name, t in stored.items():
        if name.endswith(SCALE) and name[: -len(SCALE)] in stored:
            continue
        out[name] = dequantize(t, stored[name + SCALE], block) if t.dtype == FP8 else t
    return out


def reference_fp8_merge(
    base: State,
    tasks: list[State],
    method: str,
    block: tuple[int, int],
    out_dtype: torch.dtype | None = None,
    **kw,
) -> tuple[State, dict]:
    """The RAM methods on FP8 checkpoints (any mix of FP8 and plain inputs), in stored form.

    Every input is handed to `reference_merge` as its `values`: an FP8 weight is `x`, float32,
    so a bf16 task of an FP8 base weight measures its update against `cast(x_B, bf16)`, and
    an FP8 task (decoded) against `x_B` itself ("The base at a task's precision",
    `reference.base_at`)."""
    merged, stats = reference_merge(
        values(base, block), [values(t, block) for t in tasks], method, out_dtype=out_dtype, **kw
    )
    return stored_output(merged, base, block, out_dtype), stats


def stored_output(
    merged: State, base: State, block: tuple[int, int], out_dtype: torch.dtype | None
) -> State:
    """Merged values (float32 for the base's FP8 weights) as written: FP8 again, with new
    scales, where the base is FP8 and no `out_dtype` is given."""
    out: State = {}
    for name, y in merged.items():
        if base[name].dtype == FP8 and out_dtype is None:
            out[name], out[name + SCALE] = requantize(y, base[name], base[name + SCALE], block)
        else:
            out[name] = y
    return out


def write(state: State, folder: Path, block: tuple[int, int] | None, shards: int = 1) -> None:
    """A Hugging Face folder: `shards` files (tensors in sorted-name order) with an index
    when more than one, and a config.json declaring fine-grained FP8 when `block` is given."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    config: dict = {"model_type": "llama", "torch_dtype": "bfloat16"}
    if block is not None:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file({n: state[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return
    weight_map = {}
    per = math.ceil(len(names) / shards)
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k * per : (k + 1) * per]
        save_file({n: state[n].contiguous() for n in part}, str(folder / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
