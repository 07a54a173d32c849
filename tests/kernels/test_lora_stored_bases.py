"""The LoRA product kernel over a quantized base's stored form (`kernels.lora`,
`kernels.lora_numba`): block FP8, MXFP4, compressed-tensors' packed INT4/INT8 (groups with
zero points, per channel, per tensor with a float32 scale) and FP8 (per channel, per tensor
with a float32 scale), decoded as the kernel loads each tile and rounded to bfloat16 where
the values are float32 (the base at the task's precision): the bytes of the rule step by
step on the values the tests' own decoders (`stored_forms`) and compressed-tensors give,
numba and numpy alike; no FMA in the record signature's code."""

from __future__ import annotations

import numpy as np
import pytest
from lora_steps import product_by_hand

from ram_dist.kernels import lora, lora_numba


def _compressed_base(scheme_args: dict, fmt: str, scale_dtype, rows: int = 12, cols: int = 64):
    """A compressed-tensors weight packed by compressed-tensors itself: its values as
    compressed-tensors decompresses them (the oracle, in the scale's dtype, as float32), and
    its stored form for whole rows [r0, r1) (`quantized.int_values` / `fp8_values`)."""
    import torch
    from compressed_models import Scheme, quantize

    from ram_dist.kernels import int_packed, quantized

    scheme = Scheme("re:w", fmt, scheme_args, scale_dtype)
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    packed, values = quantize(weight, scheme)
    decoded = values.to(torch.float32).reshape(-1).numpy()
    dtype = {torch.bfloat16: "BF16", torch.float32: "F32"}[values.dtype]
    scales = packed["weight_scale"].to(torch.float32).numpy().reshape(-1)
    per_row = scales.size == rows * (cols // scheme_args.get("group_size", cols))
    groups = scales.size // rows if per_row else 1
    if fmt == "float-quantized":
        q = packed["weight"].view(torch.uint8).numpy().reshape(rows, cols)

        def stored(r0: int, r1: int):
            s = scales.reshape(rows, 1)[r0:r1] if per_row else scales[:1]
            return quantized.fp8_values(q[r0:r1], s, r1 - r0, cols, dtype)

        return decoded, dtype, stored
    bits = scheme_args["num_bits"]
    words = packed["weight_packed"].numpy().view(np.uint8).reshape(rows, -1)
    zeros = None
    if "weight_zero_point" in packed:  # packed along dimension 0 (groups only, here)
        assert per_row
        raw = packed["weight_zero_point"].numpy().view(np.uint8).reshape(-1)
        zeros = int_packed.unpack_columns(raw, bits, groups)[:rows]

    def stored(r0: int, r1: int):
        s = scales.reshape(rows, groups)[r0:r1] if per_row else scales[:1].reshape(1, 1)
        z = None if zeros is None else zeros[r0:r1]
        return quantized.int_values(words[r0:r1], bits, r1 - r0, cols, s, z, dtype)

    return decoded, dtype, stored


def _stored_bases() -> dict:
    """Per format: (the base's values as float32 by the tests' own decoders, their dtype,
    stored(lo, hi) for elements on `step` boundaries, step, cols)."""
    import torch
    from stored_forms import fp8_block_base, int4_base, mxfp4_base

    out = {}
    for name, make in (("fp8-block", fp8_block_base), ("mxfp4", mxfp4_base), ("int4", int4_base)):
        b = make()
        values = b.tensor(0, b.numel).to(torch.float32).reshape(-1).numpy()
        dtype = "F32" if name == "fp8-block" else "BF16"
        out[name] = (values, dtype, b.stored, b.step, b.shape[-1])
    schemes = {
        "int4-group-zero": (dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                 group_size=32), "pack-quantized", torch.bfloat16),
        "int8-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                         "pack-quantized", torch.bfloat16),
        "int4-tensor-f32": (dict(num_bits=4, type="int", symmetric=True, strategy="tensor"),
                            "pack-quantized", torch.float32),
        "fp8-channel": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        "float-quantized", torch.bfloat16),
        "fp8-tensor-f32": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                           "float-quantized", torch.float32),
    }  # fmt: skip
    for name, (args, fmt, sd) in schemes.items():
        values, dtype, rows_of = _compressed_base(args, fmt, sd)
        out[name] = (values, dtype, (lambda r: lambda lo, hi: r(lo // 64, hi // 64))(rows_of),
                     64, 64)  # fmt: skip
    return out


STORED = _stored_bases()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("name", list(STORED))
def test_a_quantized_base_is_decoded_as_the_kernel_loads_it(name, fast):
    """A task's values over a quantized base's stored form: the base's values (decoded by
    the tests' own decoders, or compressed-tensors'), rounded to bfloat16 where they are
    float32 (the base at the task's precision), plus the product by hand, rounded to
    bfloat16; from the first element and from a later band, expert or row on."""
    import torch

    values, dtype, stored, step, cols = STORED[name]
    rng = np.random.default_rng(9)
    rows, r = values.size // cols, 3
    coef = rng.standard_normal((rows, r)).astype(np.float32) * 0.02
    basis = rng.standard_normal((r, cols)).astype(np.float32) * 0.1
    scale = np.float32(2.0)
    for lo in (0, step):
        part = stored(lo, values.size)
        theta = torch.from_numpy(values[lo:].copy()).to(torch.bfloat16).to(torch.float32).numpy()
        want = torch.from_numpy(product_by_hand(theta, coef[lo // cols :], basis, scale, lo))
        got = lora.values(part, dtype, coef[lo // cols :], basis, scale, lo, "BF16",
                          np.empty((values.size - lo) * 4, np.uint8), fast=fast)  # fmt: skip
        assert got.tobytes() == want.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_the_stored_signature_has_no_fused_multiply_add():
    _, dtype, stored, _, cols = STORED["int4-group-zero"]
    coef, basis = np.ones((12, 2), np.float32), np.ones((2, cols), np.float32)
    lora.values(stored(0, 12 * cols), dtype, coef, basis, np.float32(1), 0, "BF16",
                np.empty(12 * cols * 2, np.uint8))  # fmt: skip
    assert any(sig[0].dtype.name == "int64" for sig in lora_numba.lora_values.signatures)
    assert lora_numba.fma_instructions() == []
