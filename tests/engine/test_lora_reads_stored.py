"""A LoRA task over a quantized base, the worker functions run inline (no Ray): the LoRA
kernel decodes the base from its stored form as it loads each tile, so no copy of the
base's values is decoded for it (the base's source's `decode` is never called, in any
pass, with the kernels on, for a method whose kernels read the base as stored); the bytes
are the eager path's, which decodes the base (`exactness/test_lora_quantized_bases.py`
checks those against the references). Before, the LoRA source took the base's decoded
float32 (or bf16) values: a copy of every block of the base."""

from __future__ import annotations

import pytest
from inline_passes import FUSED, merge_inline
from lora_quantized import build
from stored_forms import count_decodes

from ram_dist.engine import worker
from ram_dist.planning.packed_sources import PackedIntSource
from ram_dist.planning.sources import Fp8Source

pytest.importorskip("numba")

#: Each base and the source class that decodes its quantized weights.
SOURCES = {"int": PackedIntSource, "fp8-channel": Fp8Source, "fp8-block": Fp8Source,
           "fbgemm": Fp8Source}  # fmt: skip


@pytest.fixture(scope="module", params=list(SOURCES))
def lora_set(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param)), SOURCES[request.param]


@pytest.fixture
def decoded(lora_set, monkeypatch) -> list[int]:
    """Elements of the base's quantized weights decoded into copies, counted."""
    return count_decodes(lora_set[1], monkeypatch)


@pytest.mark.parametrize("method", ["ties", "ram_plus"])
def test_the_lora_kernel_reads_the_base_as_stored(lora_set, decoded, method):
    s, _ = lora_set
    tasks = s.task_dirs  # two adapters and a bf16 agent
    params = {"density": 0.5} if method == "ties" else {}
    got = merge_inline(s.base_dir, tasks, method, FUSED, parameters=params,
                       out_dtype="bfloat16", unit_budget_bytes=16384)  # fmt: skip
    assert decoded == []
    eager = merge_inline(s.base_dir, tasks, method, worker.EAGER, parameters=params,
                         out_dtype="bfloat16", unit_budget_bytes=16384)  # fmt: skip
    assert got == eager
    assert sum(decoded) > 0  # the eager path did decode
