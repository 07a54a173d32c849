"""`passthrough`'s map pass on the CPU (`fused_merge`): with scale 1 and the output in the
model's dtype, a copy of the model's stored bytes, no float arithmetic. A signalling NaN's
payload survives bit for bit (the eager rule's casts through float32 may quiet it); every
other value (-0.0, subnormals, infinities, the largest finite values) has the eager rule's
bytes; another scale or another output dtype is declined (the eager rule runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_runs import stored

from ram_dist.methods import get_method
from ram_dist.methods.protocol import Chunk, ChunkWork

#: Per stored dtype: the numpy type the engine hands it as, and bit patterns of a signalling
#: NaN (quiet bit clear, a payload), a negative quiet NaN with a payload, -0.0, the least
#: subnormal, -inf and the largest finite value.
CASES = {
    torch.bfloat16: (np.uint16, [0x7F81, 0xFFC5, 0x8000, 0x0001, 0xFF80, 0x7F7F]),
    torch.float16: (np.float16, [0x7C01, 0xFE05, 0x8000, 0x0001, 0xFC00, 0x7BFF]),
    torch.float32: (np.float32, [0x7F800001, 0xFFC00005, 0x80000000, 0x1, 0xFF800000, 0x7F7FFFFF]),
}
N = 4096 + 17


def _model(dtype: torch.dtype) -> torch.Tensor:
    """Random values with the special bit patterns at fixed places."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(N, generator=g) * 0.1).to(dtype)
    special = CASES[dtype][1]
    unsigned = np.array(special, np.uint16 if dtype.itemsize == 2 else np.uint32)
    signed = torch.from_numpy(unsigned.view(np.int16 if dtype.itemsize == 2 else np.int32))
    x.view(signed.dtype)[: len(special)] = signed
    return x


@pytest.mark.parametrize("dtype", list(CASES), ids=str)
def test_passthrough_copies_the_stored_bytes(dtype) -> None:
    method = get_method("passthrough")
    params = {"scale": [1.0]}
    assert method.fuses(params)
    model = _model(dtype)
    base = torch.zeros(N, dtype=torch.float32)  # its values are never used
    chunk = Chunk("w", 0, (N,))
    out = np.empty(N, CASES[dtype][0])
    assert method.fused_merge(ChunkWork(chunk, params, {}), stored([base, model]), out)
    got = out.view(np.uint8)
    assert np.array_equal(got, model.view(torch.uint8).numpy())  # the signalling NaN included
    signalling = CASES[dtype][1][0]
    assert int(out[:1].view(np.uint16 if dtype.itemsize == 2 else np.uint32)[0]) == signalling
    # every value but the NaNs has the eager rule's bytes
    eager = method.merge_chunk(ChunkWork(chunk, params, {}), base, [model]).to(dtype)
    width = dtype.itemsize
    same = got.reshape(-1, width) == eager.view(torch.uint8).numpy().reshape(-1, width)
    nan = model.float().isnan().numpy()
    assert nan[:2].all() and nan.sum() == 2
    assert same[~nan].all()


def test_passthrough_declines_what_is_not_a_copy() -> None:
    """A scale other than 1 multiplies (eager rule); an output dtype other than the model's
    is a cast (eager rule)."""
    method = get_method("passthrough")
    model = _model(torch.bfloat16)
    inputs = stored([torch.zeros(N), model])
    chunk = Chunk("w", 0, (N,))
    assert not method.fuses({"scale": [0.5]})
    out = np.empty(N, np.uint16)
    assert not method.fused_merge(ChunkWork(chunk, {"scale": [0.5]}, {}), inputs, out)
    for other in (np.float16, np.float32, np.float64):
        wide = np.empty(N, other)
        assert not method.fused_merge(ChunkWork(chunk, {"scale": [1.0]}, {}), inputs, wide)
