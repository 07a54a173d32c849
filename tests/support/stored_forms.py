"""Tiny quantized bases in the forms the fused kernels read (`kernels.fp8.Fp8Values`,
`kernels.quantized.QuantizedValues`), each with its decoded copy as the engine would hand it
(float32 for block FP8, bfloat16 bits for MXFP4 and INT4), and bf16 agents near it; and a
method's reduce rounds and map pass run chunk by chunk on the stored form, on the decoded
copy, or eagerly (`run_method`), as `engine.reduce_step` and `engine.map_step` call them.

The bases are packed by the tests' own packers (`fp8_reference.quantize`,
`mxfp4_models.pack`, compressed-tensors through `compressed_models.quantize`) and their
decoded copies come from the same independent decoders, never from ram_dist.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ram_dist.kernels import fp8, quantized
from ram_dist.methods.protocol import Chunk, ChunkWork, MergeMethod, RoundTotals


@dataclass(frozen=True)
class StoredBase:
    """A base tensor of `shape`: its decoded values (flat, as the engine hands them) and, for
    elements [lo, hi) on `step` boundaries (a band, an expert, a row), its stored form."""

    name: str
    shape: tuple[int, ...]
    decoded: np.ndarray
    step: int
    stored: Callable[[int, int], Any]

    @property
    def numel(self) -> int:
        return int(self.decoded.size)

    def tensor(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the decoded values as a torch tensor (the eager rule's)."""
        part = self.decoded[lo:hi]
        if part.dtype == np.uint16:
            return torch.from_numpy(part.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(part.copy())


def fp8_block_base(rows: int = 8, cols: int = 48, block: tuple[int, int] = (4, 16)) -> StoredBase:
    """Block FP8 (DeepSeek's layout, small blocks) with float32 scales."""
    from fp8_reference import dequantize, quantize

    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 0, cols)
    q, s = quantize(x, block)
    values = dequantize(q, s, block).reshape(-1).numpy()
    q_bytes = q.view(torch.uint8).reshape(-1).numpy()
    scales = s.to(torch.float32).numpy()
    bm = block[0]

    def stored(lo: int, hi: int) -> fp8.Fp8Values:
        r0, r1 = lo // cols, hi // cols
        bands = scales[r0 // bm : -(-r1 // bm)]
        return fp8.Fp8Values(q_bytes[lo:hi], bands.reshape(-1), cols, block)

    return StoredBase("fp8-block", (rows, cols), values, bm * cols, stored)


def mxfp4_base(experts: int = 2, groups: int = 2, rows: int = 24) -> StoredBase:
    """gpt-oss's MXFP4: values [E, groups * 32, rows], cut between experts."""
    from mxfp4_models import decode, pack

    g = torch.Generator().manual_seed(2)
    x = torch.randn(experts, groups * 32, rows, generator=g) * 0.05
    blocks, scales = pack(x)
    values = decode(blocks, scales).to(torch.bfloat16)
    bits = values.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    b, s = blocks.numpy(), scales.numpy()
    per = groups * 32 * rows

    def stored(lo: int, hi: int) -> quantized.QuantizedValues:
        e0, e1 = lo // per, hi // per
        return quantized.mxfp4_values(b[e0:e1], s[e0:e1], rows, groups)

    return StoredBase("mxfp4", (experts, groups * 32, rows), bits, per, stored)


def int4_base(rows: int = 16, cols: int = 64, group: int = 32) -> StoredBase:
    """compressed-tensors' pack-quantized INT4, symmetric, groups of `group`, bf16 scales
    (W4A16's and Kimi-K2's scheme without the zero point), cut between rows."""
    from compressed_models import Scheme, quantize

    scheme = Scheme(
        "re:w", "pack-quantized",
        dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    packed, values = quantize(weight, scheme)
    assert values.dtype == torch.bfloat16
    bits = values.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    words = packed["weight_packed"].numpy().view(np.uint8).reshape(rows, -1)
    scales = packed["weight_scale"].to(torch.float32).numpy()

    def stored(lo: int, hi: int) -> quantized.QuantizedValues:
        r0, r1 = lo // cols, hi // cols
        return quantized.int_values(words[r0:r1], 4, r1 - r0, cols, scales[r0:r1], None, "BF16")

    return StoredBase("int4", (rows, cols), bits, cols, stored)


BASES = {"fp8-block": fp8_block_base, "mxfp4": mxfp4_base, "int4": int4_base}


def compressed_base(which: str, rows: int = 16, cols: int = 64) -> StoredBase:
    """A compressed-tensors base packed by the package itself, cut between rows, its decoded
    copy compressed-tensors' own (bf16 scales, so bf16 values): `int4-zero` (INT4 groups of
    32 with zero points, packed along dimension 0), `int8-channel` (INT8, a scale per row)
    or `fp8-channel` (`float-quantized` FP8, a scale per row)."""
    from compressed_models import FP8_SCHEMES, INT_SCHEMES, quantize
    from compressed_tensors.compressors.pack_quantized.base import unpack_from_int32

    scheme = {"int4-zero": INT_SCHEMES[0], "int8-channel": INT_SCHEMES[1],
              "fp8-channel": FP8_SCHEMES[0]}[which]  # fmt: skip
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    packed, values = quantize(weight, scheme)
    assert values.dtype == torch.bfloat16
    bits = values.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    scales = packed["weight_scale"].to(torch.float32).numpy()
    nbits = scheme.weights["num_bits"]
    zeros = None
    if "weight_zero_point" in packed:
        unpacked = unpack_from_int32(packed["weight_zero_point"], nbits, scales.shape, 0)
        zeros = unpacked.numpy().astype(np.int16)
    if which == "fp8-channel":
        q = packed["weight"].view(torch.uint8).numpy().reshape(rows, cols)
    else:
        words = packed["weight_packed"].numpy().view(np.uint8).reshape(rows, -1)

    def stored(lo: int, hi: int) -> quantized.QuantizedValues:
        r0, r1 = lo // cols, hi // cols
        if which == "fp8-channel":
            return quantized.fp8_values(q[r0:r1], scales[r0:r1], r1 - r0, cols, "BF16")
        z = None if zeros is None else zeros[r0:r1]
        return quantized.int_values(words[r0:r1], nbits, r1 - r0, cols, scales[r0:r1], z, "BF16")

    return StoredBase(which, (rows, cols), bits, cols, stored)


#: The compressed-tensors forms beyond `BASES`' INT4 (`compressed_base`).
COMPRESSED = ("int4-zero", "int8-channel", "fp8-channel")


def bf16_agents(base: StoredBase, n: int, seed: int = 0) -> list[np.ndarray]:
    """n bf16 agents (bits) as a trainer saves them: the base in bf16, with 3 %, 46 %, 54 %
    ... of the elements moved."""
    full = base.tensor(0, base.numel).float()
    g = torch.Generator().manual_seed(seed)
    agents = []
    for t in range(n):
        mask = torch.rand(base.numel, generator=g) < (0.03, 0.46, 0.54, 0.3)[t % 4]
        step = (1e-3 + full.abs() * 2**-6) * torch.randn(base.numel, generator=g)
        agent = (full + torch.where(mask, step, 0.0)).to(torch.bfloat16)
        agents.append(agent.view(torch.int16).numpy().view(np.uint16))
    return agents


def _bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


@dataclass
class MethodRun:
    """What `run_method` gives: the merged bytes, each round's totals, and how many chunks
    the fused kernels took in each pass (the rest ran the eager rule, as the engine does)."""

    merged: bytes
    totals: list[dict[str, np.ndarray]]
    fused_rounds: int
    fused_merges: int


def run_method(
    method: MergeMethod,
    params: dict[str, Any],
    base: StoredBase,
    agents: list[np.ndarray],
    bounds: list[int],
    mode: str,
) -> MethodRun:
    """A method's rounds and map pass over chunks [bounds[k], bounds[k+1]) into bf16: the
    base `stored` (its stored form to the kernels), `decoded` (its decoded copy), or
    `eager` (the torch rule). A fused call that declines falls back to the eager rule."""
    numel, n = base.numel, len(agents)
    state = method.initial_state({"w": params}, {"w": numel}, n)
    spans = list(zip(bounds, bounds[1:], strict=False))

    def kernel_inputs(lo: int, hi: int) -> list[Any]:
        first = base.stored(lo, hi) if mode == "stored" else base.decoded[lo:hi]
        return [first, *(a[lo:hi] for a in agents)]

    def eager_inputs(lo: int, hi: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return base.tensor(lo, hi), [_bf16_tensor(a[lo:hi]) for a in agents]

    rounds, fused_rounds = [], 0
    for round_ in range(method.rounds):
        if not method.active(round_, state, "w"):
            continue
        totals: dict[str, np.ndarray] = {}
        for lo, hi in spans:
            work = ChunkWork(Chunk("w", lo, base.shape), params, state, round_)
            got = None
            if mode != "eager":
                got = method.fused_statistics(work, kernel_inputs(lo, hi))
            if got is not None:
                stats = dict(got[0])
                fused_rounds += 1
            else:
                b, ts = eager_inputs(lo, hi)
                eager = method.chunk_statistics(work, b, ts)
                stats = {k: v.numpy() for k, v in eager.items()}
            for key, value in stats.items():
                value = np.asarray(value, np.int64)
                totals[key] = totals[key] + value if key in totals else value
        rounds.append(totals)
        sums = {k: torch.from_numpy(v) for k, v in totals.items()}
        state = method.finalize(RoundTotals(round_, sums, {"w": params}, {"w": numel}, state))
        state = json.loads(json.dumps(state))
    parts, fused_merges = [], 0
    for lo, hi in spans:
        chunk = Chunk("w", lo, base.shape)
        out = np.empty(hi - lo, np.uint16)
        if mode != "eager" and method.fused_merge(
            ChunkWork(chunk, params, state), kernel_inputs(lo, hi), out
        ):
            fused_merges += 1
        else:
            b, ts = eager_inputs(lo, hi)
            merged = method.merge_chunk(ChunkWork(chunk, params, state), b, ts).to(torch.bfloat16)
            out = merged.reshape(-1).view(torch.int16).numpy().view(np.uint16)
        parts.append(out)
    return MethodRun(np.concatenate(parts).tobytes(), rounds, fused_rounds, fused_merges)


def count_decodes(source: type, monkeypatch: Any) -> list[int]:
    """The elements a decoded source (a `planning.sources` class: a quantized input's, a LoRA
    task's) decodes into copies from now on, one entry a call: its `decode` wrapped for the
    test (`monkeypatch` undoes it)."""
    counts: list[int] = []
    decode = source.decode

    def counting(self, start, stop, read, floats, base):  # noqa: ANN001, ANN202
        counts.append(stop - start)
        return decode(self, start, stop, read, floats, base)

    monkeypatch.setattr(source, "decode", counting)
    return counts
