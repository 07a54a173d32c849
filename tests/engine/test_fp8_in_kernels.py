"""The worker functions run inline (no Ray) on FP8 checkpoints with the fused kernels on:
RAM's kernels read every FP8 input as stored and write the FP8 output themselves, so no
input is ever dequantized into a float32 copy (`Fp8Source.decode` is never called), and the
bytes are the spec's reference's (`fp8_reference`), for an FP8 base with FP8 or bf16
agents, a bf16 base with FP8 agents, and `out_dtype`. Every other method of the registry
whose kernels read quantized inputs (`MergeMethod.reads_stored`: TIES's, DELLA's, the
geometric blend's, model_stock's, sce's, arcee_fusion's...) reads them as stored too, with
the eager path's bytes, in its rounds too (the geometric methods' and model_stock's Gram
rounds, sce's variance selection and sums of squares)."""

from __future__ import annotations

import pytest
import torch
from fp8_models import BLOCK, build_fp8_set
from fp8_reference import reference_fp8_merge
from inline_passes import FUSED, merge_inline
from method_cases import case_id, every_method, task_count, tensor_parameters
from stored_forms import count_decodes

from ram_dist.cli import flag_table
from ram_dist.engine import blocks, worker
from ram_dist.kernels import fp8
from ram_dist.methods.registry import METHODS
from ram_dist.planning.sources import Fp8Source

pytest.importorskip("numba")

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

SETS = {
    "fp8": dict(base_format="fp8", task_formats=("fp8", "fp8", "fp8")),
    "fp8-base-bf16-agent": dict(base_format="fp8", task_formats=("fp8", "fp8", "bf16")),
    "bf16-base-fp8-agents": dict(base_format="bf16", task_formats=("fp8", "bf16", "fp8")),
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8-kernels")
    return {name: build_fp8_set(root / name, **spec) for name, spec in SETS.items()}


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """Elements of FP8 inputs dequantized into float32 copies, counted."""
    return count_decodes(Fp8Source, monkeypatch)


def _merge_inline(s, method_name: str, flags=FUSED, **kw) -> dict[str, bytes]:
    """Both passes, unit by unit in this process; the output tensors' bytes by name (as
    many tasks as the method takes: arcee_fusion and slerp one)."""
    tasks = s.task_dirs[: task_count(method_name, len(s.task_dirs))]
    return merge_inline(s.base_dir, tasks, method_name, flags, **kw)


def _expected(s, method: str, out_dtype: torch.dtype | None = None, **kw) -> dict[str, bytes]:
    want, _ = reference_fp8_merge(s.base, s.tasks, method, BLOCK, out_dtype=out_dtype, **kw)
    return {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for n, t in want.items()}  # fmt: skip


@pytest.mark.parametrize("which", list(SETS))
def test_ram_reads_and_writes_fp8_in_its_kernels(sets, which, decoded, monkeypatch):
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", 16 * 45 * 2)  # several blocks a unit
    got = _merge_inline(sets[which], "ram_plus")
    assert got == _expected(sets[which], "ram_plus")
    assert decoded == []  # no FP8 input was dequantized into a float32 copy


def test_out_dtype_from_fp8_inputs_in_the_kernels(sets, decoded):
    got = _merge_inline(sets["fp8"], "ram", out_dtype="bfloat16")
    assert got == _expected(sets["fp8"], "ram", torch.bfloat16)
    assert decoded == []


#: Each method's parameters here (selecting ones where it has them), for the test of FP8
#: output below.
PARAMETERS = {"ties": {"density": 0.5}, "della": {"density": 0.5}}
#: Every method whose kernels read quantized inputs as stored but leave FP8 output to the
#: engine (RAM's kernels write it: the tests above), as its case in `method_cases`.
STORED = [
    (name, params) for name, params in every_method()
    if METHODS[name].reads_stored and not getattr(METHODS[name], "writes_fp8", False)
]  # fmt: skip


@pytest.mark.parametrize("case", STORED, ids=case_id)
def test_every_method_s_kernels_read_fp8_as_stored(sets, decoded, case):
    """Every method's kernels read the FP8 inputs as stored too, in its rounds where they are
    fused and in its map pass where its kernels take the tensor (`fuses`), as docs/methods.md's
    kernel table says (`flag_table.kernel_cells`): no FP8 input is dequantized into a float32
    copy there, and the bytes are the eager path's, which dequantizes them
    (`test_fp8_checkpoints` checks those against the rule). bf16 output: FP8 output from a
    method other than RAM is requantized from the merged values and the base's."""
    method, parameters = case
    s = sets["fp8-base-bf16-agent"]
    n = task_count(method, len(s.task_dirs))
    fused_map = METHODS[method].fuses(tensor_parameters(method, parameters, n))
    rounds_cell, map_cell, quantized_cell, _ = flag_table.kernel_cells(METHODS[method])
    assert (map_cell == "fused kernels") == fused_map
    fused_rounds = "on fused kernels" in rounds_cell
    assert quantized_cell == ("as stored" if fused_map or fused_rounds else "decoded")
    starts: list[int] = []  # where each pass starts in `decoded`

    def mark(name: str) -> None:
        starts.append(len(decoded))

    kw = {"on_pass": mark, "out_dtype": "bfloat16", "parameters": parameters}
    got = _merge_inline(s, method, **kw)
    rounds = decoded[: starts[-1]]
    assert (rounds == []) == (fused_rounds or METHODS[method].rounds == 0)  # fused: nothing
    assert (decoded[starts[-1] :] == []) == fused_map  # nor did a fused map pass
    before = len(decoded)
    eager = _merge_inline(s, method, worker.EAGER, out_dtype="bfloat16", parameters=parameters)
    assert got == eager
    assert sum(decoded[before:]) > 0  # the eager path did


@pytest.mark.parametrize("method", ["ties", "della", "task_arithmetic"])
def test_fp8_output_of_another_method_never_decodes_the_base(sets, decoded, method, monkeypatch):
    """FP8 output from a method other than RAM: its kernels merge the stored inputs into
    float32, and the engine requantizes band by band with the base's values made from its
    stored bytes a few bands at a time (`fp8.requantize_stored`), so the map pass
    dequantizes no input into a copy; the bytes are the eager path's (which dequantizes) and,
    with one band a group, the same."""
    s = sets["fp8-base-bf16-agent"]
    params = {"parameters": PARAMETERS.get(method, {})}
    starts: list[int] = []

    def mark(name: str) -> None:
        starts.append(len(decoded))

    got = _merge_inline(s, method, on_pass=mark, **params)
    assert decoded[starts[-1] :] == []
    eager = _merge_inline(s, method, worker.EAGER, **params)
    assert got == eager
    monkeypatch.setattr(fp8, "BAND_GROUP", 1)  # one band at a time
    assert _merge_inline(s, method, **params) == eager
