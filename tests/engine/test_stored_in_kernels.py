"""The worker functions run inline (no Ray) on a gpt-oss MXFP4 base, a compressed-tensors
INT base (INT4 groups with zero points, INT8 per channel, INT4 per tensor) and a
compressed-tensors FP8 base (per channel, per tensor), with bf16 agents, kernels on: TIES's,
DELLA's, the geometric blend's, model_stock's, sce's and arcee_fusion's kernels read the base
as stored (`MergeMethod.reads_stored`), so in the map pass (and in TIES's, DELLA's and
arcee_fusion's rounds) no quantized input is decoded into a copy (its source's `decode` is
never called), and the bytes are those of the eager path on whole tensors, which decodes it
(`exactness/test_mxfp4_bases.py` and `test_compressed_bases.py` check those against
references). Their rounds read it as stored too (model_stock's and the geometric methods'
Gram rounds, sce's variance selection and sums of squares). The first round's NaN/Inf check
of a method other than RAM's (which counts them in its own sweep) reads them as stored too.
(Block FP8: `test_fp8_in_kernels.py`.)"""

from __future__ import annotations

import pytest
from compressed_models import FP8_SCHEMES, INT_SCHEMES
from compressed_models import build_set as build_compressed
from inline_passes import FUSED, check_round_inline, merge_inline
from mxfp4_models import build_set as build_gptoss
from stored_forms import count_decodes

from ram_dist.engine import worker
from ram_dist.planning.packed_sources import PackedIntSource
from ram_dist.planning.sources import Fp8Source, Mxfp4Source

pytest.importorskip("numba")

#: Each format's base and the source class that decodes it.
FORMATS = {
    "mxfp4": (lambda root: build_gptoss(root, (0.01, 0.01)), Mxfp4Source),
    "int": (lambda root: build_compressed(root, INT_SCHEMES, (0.01, 0.01)), PackedIntSource),
    "fp8-channel": (lambda root: build_compressed(root, FP8_SCHEMES, (0.01, 0.01)), Fp8Source),
}
#: Parameters that make the methods select (TIES's four rounds, consensus_ties' masks too,
#: DELLA's sampling), and multislerp's required weight.
PARAMETERS = {
    "ties": {"density": 0.5}, "consensus_ties": {"density": 0.5, "k": 2, "lambda": 0.5},
    "della": {"density": 0.5, "epsilon": 0.1, "seed": 3},
    "multislerp": {"weight": 0.6}, "sce": {"select_topk": 0.5},
}  # fmt: skip


#: The eager path's unit budget: whole tensors (its bytes are the same at any budget, and
#: it decodes per unit, so fewer units cost less).
WHOLE = 10**8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each format's set, built the first time a test asks for it."""
    sets = {}

    def get(fmt: str):
        if fmt not in sets:
            sets[fmt] = FORMATS[fmt][0](tmp_path_factory.mktemp(fmt))
        return sets[fmt]

    return get


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized_set(request, built):
    return built(request.param), FORMATS[request.param][1]


@pytest.fixture
def decoded(quantized_set, monkeypatch) -> list[int]:
    """Elements of the base's quantized tensors decoded into copies, counted."""
    return count_decodes(quantized_set[1], monkeypatch)


def _merge(s, method: str, flags: worker.WorkFlags = FUSED, **kw) -> dict[str, bytes]:
    parameters = PARAMETERS.get(method, {})
    agents = s.agent_dirs[:1] if method == "arcee_fusion" else s.agent_dirs  # one model
    return merge_inline(s.base_dir, agents, method, flags, parameters=parameters, **kw)


@pytest.mark.parametrize(
    "method",
    ["ties", "consensus_ties", "della", "multislerp", "model_stock", "sce", "arcee_fusion"],
)
def test_the_kernels_read_the_base_as_stored(quantized_set, decoded, method):
    s, _ = quantized_set
    starts: list[int] = []  # where each pass starts in `decoded`

    def mark(name: str) -> None:
        starts.append(len(decoded))

    got = _merge(s, method, on_pass=mark, out_dtype="bfloat16")
    assert decoded[starts[-1] :] == []  # the map pass decoded nothing
    assert decoded == []  # nor did the rounds
    assert got == _merge(s, method, worker.EAGER, out_dtype="bfloat16", unit_budget_bytes=WHOLE)
    assert sum(decoded[starts[-1] :]) > 0  # the eager path did


@pytest.mark.parametrize("method", ["task_arithmetic", "consensus_ta", "linear"])
def test_the_first_rounds_nan_check_reads_the_base_as_stored(quantized_set, decoded, method):
    """The first round's NaN/Inf check of a method other than RAM's counts a quantized
    input's non-finite values from its stored codes and scales (`kernels.stored_nonfinite`):
    fused, the round decodes nothing (a method with no reduce round of its own, or no
    kernels: `linear`), and on these finite bases it finds nothing, with kernels on or off.
    (`kernels/test_stored_nonfinite.py` checks the counts against decoding.)"""
    s, _ = quantized_set
    agents = s.agent_dirs
    extra = {"parameters": {"k": 2, "lambda": 0.5}} if method == "consensus_ta" else {}
    assert check_round_inline(s.base_dir, agents, method, FUSED, **extra) == {}
    assert decoded == []
    eager = check_round_inline(s.base_dir, agents, method, worker.EAGER, unit_budget_bytes=WHOLE,
                               **extra)  # fmt: skip
    assert eager == {}


def test_a_nan_scale_is_counted_as_the_ram_family_counts_it(built, tmp_path):
    """An MXFP4 scale byte of 255 (e8m0's NaN): task_arithmetic's check round, from the
    stored form, finds the 32 values of its group in the base alone, as RAM+'s own sweep
    over the same inputs does (the engine's refusal names what both find)."""
    import shutil

    from safetensors.torch import load_file, save_file

    s = built("mxfp4")
    base = tmp_path / "base"
    shutil.copytree(s.base_dir, base)
    name = "model.layers.1.mlp.experts.down_proj"
    shard = next(
        f for f in base.glob("*.safetensors") if name + "_scales" in load_file(str(f))
    )  # fmt: skip
    state = load_file(str(shard))
    state[name + "_scales"][1, 3, 0] = 255
    save_file(state, str(shard), {"format": "pt"})
    found = check_round_inline(base, s.agent_dirs, "task_arithmetic")
    assert found == {name: [32, 0, 0]}
    assert check_round_inline(base, s.agent_dirs, "ram_plus") == found
