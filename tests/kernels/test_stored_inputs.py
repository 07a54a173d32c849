"""Every method whose fused kernels read quantized inputs as stored
(`MergeMethod.reads_stored`), on a block FP8 base, an MXFP4 base and an INT4 base with bf16
agents (`support/stored_forms.py`): its reduce rounds and map pass, chunk by chunk as the
engine runs them, give on the stored form exactly the statistics and the bytes they give on
the decoded copy, and those of the eager rule; the kernels were handed the stored form (a
record of its kind, `views.kernel_inputs`), so no decoded copy reached them; and the fused
kernels take the same chunks on both.

Which methods read the stored form is a claim checked here too: every method with fused
kernels does, in every fused round too (the Gram rounds of model_stock and the geometric
methods and sce's sums of squares included: `vector_sums_numba`)."""

from __future__ import annotations

import numpy as np
import pytest
from method_cases import case_id, case_parameters, every_method, task_count
from stored_forms import BASES, bf16_agents, run_method

from ram_dist.methods.protocol import Eager
from ram_dist.methods.registry import METHODS
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.tensor_params import resolve_all

numba = pytest.importorskip("numba")

from ram_dist.kernels import (  # noqa: E402
    arcee_numba,
    blend_numba,
    dare_numba,
    della_numba,
    ram_numba,
    sce_numba,
    ties_numba,
    vector_sums_numba,
    views,
)
from ram_dist.methods.ram import RamMethod  # noqa: E402

STORED = [case for case in every_method() if METHODS[case[0]].reads_stored]


def _fused(name: str) -> bool:
    """Whether a method has fused kernels (overrides Eager's refusals)."""
    kind = type(METHODS[name])
    return kind.fused_statistics is not Eager.fused_statistics or kind.fuses is not Eager.fuses


def test_every_method_with_fused_kernels_reads_the_stored_form():
    """passthrough's map pass is a copy of the model's bytes, not a kernel that decodes: a
    quantized model reaches it decoded (test_passthrough_copy)."""
    fused = {name for name in METHODS if _fused(name)} - {"passthrough"}
    stored = {name for name, m in METHODS.items() if m.reads_stored}
    assert stored == fused
    assert {name for name, m in METHODS.items() if m.writes_fp8} <= {
        name for name, m in METHODS.items() if isinstance(m, RamMethod)
    }


def _params(name: str, n: int) -> dict:
    config = MergeConfig(
        base="b", tasks=tuple(f"t{i}" for i in range(n)), out="o", method=name,
        parameters=case_parameters(name),
    )  # fmt: skip
    return resolve_all(config, METHODS[name], ["w"])["w"]


def _stored_records(monkeypatch) -> list[int]:
    """The kinds of the stored forms' records the kernels' wrappers make from now on (FP8
    and quantized inputs as stored, `views.kernel_inputs`)."""
    from ram_dist.kernels import primitives

    made: list[int] = []
    record = views._record

    def spy(view):  # noqa: ANN001, ANN202
        rec = record(view)
        if rec[primitives.KIND] in (primitives.FP8, primitives.QUANTIZED):
            made.append(rec[primitives.KIND])
        return rec

    monkeypatch.setattr(views, "_record", spy)
    return made


@pytest.fixture(scope="module", params=list(BASES))
def base(request):
    return BASES[request.param]()


@pytest.mark.parametrize("case", STORED, ids=case_id)
def test_the_stored_form_gives_the_decoded_copy_s_bytes(base, case, monkeypatch):
    name, _ = case
    method = METHODS[name]
    n = task_count(name, 3)
    params = _params(name, n)
    agents = bf16_agents(base, n, seed=5)
    # chunks of one step (band, expert, row), then of the rest: whole rows for DELLA too
    bounds = [0, base.step, base.numel]
    got = {mode: run_method(method, params, base, agents, bounds, mode)
           for mode in ("decoded", "eager")}  # fmt: skip
    records = _stored_records(monkeypatch)
    got["stored"] = run_method(method, params, base, agents, bounds, "stored")
    monkeypatch.undo()
    for mode in ("decoded", "eager"):
        assert got["stored"].merged == got[mode].merged, f"stored vs {mode}"
        assert len(got["stored"].totals) == len(got[mode].totals)
        for mine, theirs in zip(got["stored"].totals, got[mode].totals, strict=True):
            assert mine.keys() == theirs.keys()
            for key in mine:
                np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{mode} {key}")
    stored, decoded = got["stored"], got["decoded"]
    assert stored.fused_merges == decoded.fused_merges
    assert stored.fused_rounds == decoded.fused_rounds  # every fused round reads it as stored
    if method.fuses(params):
        assert stored.fused_merges == len(bounds) - 1
    # the kernels that ran were handed the stored form (a record each call), not a copy
    assert len(records) >= stored.fused_rounds + stored.fused_merges
    assert not records or set(records) == {records[0]}


def test_no_fma_in_the_kernels_compiled_for_stored_forms():
    """TIES's, DARE's, DELLA's, the blend's (linear's too), model_stock's, nearswap's, sce's,
    arcee_fusion's and the statistics' exact sums' code for a stored base has no FMA. Their
    signature is records (every kind's loaders in one): each kernel, called here on each stored
    base and on its decoded copy (a plain array), holds one specialization, the one plain inputs
    give it, whose code each kernel's own no-FMA test compiles uncached and inspects
    (test_ties_kernels, test_dare_kernels, test_sparse_kernels, test_blend_kernels,
    test_sce_kernels, test_arcee_kernels) inspects. The Gram kernel, which only the
    stored-form tests call, is inspected here (`fma_check.fma_findings`)."""

    for make in BASES.values():
        base = make()
        agents = bf16_agents(base, 2, seed=7)
        for first in (base.stored(0, base.numel), base.decoded):
            _call_every_record_kernel(first, agents, base.numel, base.shape[-1])
    arcee = (arcee_numba._importance_kernel, arcee_numba._merge_kernel)
    kernels = (*ties_numba.KERNELS, *dare_numba.KERNELS, *della_numba.KERNELS,
               *blend_numba.KERNELS, *sce_numba.KERNELS, *vector_sums_numba.KERNELS)  # fmt: skip
    for kernel in (*kernels, *arcee):
        assert len(kernel.signatures) == 1, (kernel, kernel.signatures)
    for kernel in vector_sums_numba.KERNELS:
        assert kernel.signatures and ram_numba.fma_findings(kernel) == [], kernel


def _call_every_record_kernel(first, agents: list, numel: int, row: int) -> None:
    """Each record kernel above through its public wrapper, `first` (a stored form or a plain
    array) the first input."""
    out = np.empty(numel, np.uint16)
    ties_numba.statistics(first, agents, ties_numba.HIGH, 1 << 15)
    ties_numba.merge(first, agents, out, weights=[0.5, 0.25], keep=[2, 0],
                     cuts=[(0, -1)] * 2, start=0, consensus=True, normalize=True,
                     divisor=1.0, lambda_=0.5)  # fmt: skip
    draws = dict(start=0, stream_keys=[1, None], thresholds=[1 << 23, 0])
    dare_numba.statistics(first, agents, **draws)
    dare_numba.merge(first, agents, out, **draws, factors=[1.5, None], weights=[0.5, 0.25],
                     consensus=True, normalize=True, divisor=1.0, lambda_=0.5)  # fmt: skip
    kw = dict(start=0, groups=(numel, 1), stream_keys=[1, None], densities=[0.5, 1.0],
              epsilons=[0.1, 0.1])  # fmt: skip
    della_numba.statistics(first, agents, **kw)
    della_numba.merge(first, agents, out, **kw, factors=[1.5, None], weights=[0.5, 0.25],
                      consensus=True, normalize=True, divisor=1.0, lambda_=0.5)  # fmt: skip
    blend_numba.blend(first, agents, out, mode=blend_numba.DELTAS, factors=[0.3, 0.7])
    blend_numba.stock(first, agents, out, ts=[0.3])
    blend_numba.nearswap(first, agents[0], out, t=0.3, floor=1e-6)
    sce_numba.merge(first, agents, out, weights=[0.6, 0.4], select=sce_numba.SELECT_CUT,
                    threshold=1 << 20, start=0)  # fmt: skip
    sce_numba.statistics(first, agents, sce_numba.SQUARES, threshold=1 << 20)
    imp = arcee_numba.importance(first, agents[0], row)
    arcee_numba.merge(first, agents[0], imp, 1e-4, out)
    vector_sums_numba.gram(first, agents, vector_sums_numba.DELTAS, [(0, 0), (0, 1)])


def test_model_stock_filter_wise_reads_the_stored_form_for_its_row_sums(base):
    """filter_wise's ratios are exact sums of each row's float32 task vectors: on a stored
    form its fused map pass takes every chunk (the row sums from the records, decoded as
    they load) and gives the decoded copy's bytes and the eager rule's."""
    method = METHODS["model_stock"]
    params = _params("model_stock", 3) | {"filter_wise": True}
    agents = bf16_agents(base, 3, seed=9)
    bounds = [0, base.step, base.numel]
    got = {mode: run_method(method, params, base, agents, bounds, mode)
           for mode in ("stored", "decoded", "eager")}  # fmt: skip
    assert got["stored"].merged == got["decoded"].merged == got["eager"].merged
    assert got["stored"].fused_merges == got["decoded"].fused_merges == len(bounds) - 1
