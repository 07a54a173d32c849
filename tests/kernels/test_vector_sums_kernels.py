"""The statistics rounds from the inputs as stored (`kernels.vector_sums_numba`, nuslerp's
per-column sums, `column_sums_numba`, sce's selection, `sce_numba.statistics`): on every
quantized base form (block FP8,
gpt-oss MXFP4, compressed-tensors INT4 with and without zero points, INT8 per channel and
FP8 per channel; `support/stored_forms.py`) with bf16 agents, the sums the kernels take from
the stored form are those of the decoded copy, bin for bin, and each one rounded once is
`math.fsum` of the float64 products of the vectors the eager rule forms (the reference,
written here from the spec's rule); sce's selection's histograms are `topk`'s of the eager
variance keys; and model_stock (whole and filter_wise), sce (with and without selection) and
the geometric methods' Gram rounds (slerp's pair, nuslerp's task vectors whole and per
column, karcher's models, multislerp) take every chunk fused on the stored form,
at unit budgets of one step (band, expert, row) and of the whole tensor, with the bytes and
totals of the decoded copy and of the eager rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from method_cases import case_parameters, task_count
from stored_forms import BASES, COMPRESSED, bf16_agents, compressed_base, run_method

from ram_dist.methods import exact_sums
from ram_dist.methods.geometric import columns
from ram_dist.methods.protocol import Chunk, ChunkWork
from ram_dist.methods.registry import METHODS
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.tensor_params import resolve_all

pytest.importorskip("numba")

from ram_dist.kernels import column_sums, vector_sums_numba  # noqa: E402

FORMS = [*BASES, *COMPRESSED]


def _make(name: str):
    return BASES[name]() if name in BASES else compressed_base(name)


@pytest.fixture(scope="module", params=FORMS)
def base(request):
    return _make(request.param)


def _f32(bits: np.ndarray) -> np.ndarray:
    """A decoded copy or an agent as float32 values (bfloat16 bits widened, exactly)."""
    if bits.dtype == np.uint16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.astype(np.float32)


def _reference_vectors(decoded: np.ndarray, agents: list[np.ndarray], mode: int) -> list:
    """The vectors as the spec forms them, in float32, from the decoded base (its values'
    dtype: bf16 for MXFP4 and compressed-tensors, float32 for block FP8) and bf16 agents:
    a bf16 agent of a float32 base measures against the base rounded to bf16."""
    b = _f32(decoded)
    if decoded.dtype == np.uint16:
        at = b
    else:
        at = torch.from_numpy(b).to(torch.bfloat16).float().numpy()
    xs = [_f32(a) for a in agents]
    if mode == vector_sums_numba.DELTAS:
        return [x - at for x in xs]
    if mode == vector_sums_numba.MODELS:
        return xs
    return [b, xs[0] if at is b else b + (xs[0] - at)]


def _fsum(x: np.ndarray, y: np.ndarray) -> float:
    return math.fsum((x.astype(np.float64) * y.astype(np.float64)).tolist())


@pytest.mark.parametrize(
    "mode", [vector_sums_numba.DELTAS, vector_sums_numba.PAIR, vector_sums_numba.MODELS],
    ids=["deltas", "pair", "models"],
)  # fmt: skip
@pytest.mark.parametrize("per_row", [False, True], ids=["whole", "rows"])
def test_the_stored_form_s_sums_are_the_decoded_copy_s_and_the_reference(base, mode, per_row):
    agents = bf16_agents(base, 3, seed=11)
    n = 2 if mode == vector_sums_numba.PAIR else 3
    pairs = exact_sums.pairs_of(n)
    row = base.shape[-1] if per_row else 0
    stored = vector_sums_numba.gram(base.stored(0, base.numel), agents, mode, pairs, row)
    decoded = vector_sums_numba.gram(base.decoded, agents, mode, pairs, row)
    np.testing.assert_array_equal(stored, decoded)
    vectors = _reference_vectors(base.decoded, agents, mode)
    length = row or base.numel
    assert stored.shape[0] == base.numel // length
    for r in range(stored.shape[0]):
        part = slice(r * length, (r + 1) * length)
        for k, (i, j) in enumerate(pairs):
            want = _fsum(vectors[i][part], vectors[j][part])
            assert exact_sums.value(stored[r, k]) == want, (r, i, j)


def test_nuslerp_s_column_sums_from_the_stored_form(base):
    agents = bf16_agents(base, 2, seed=12)
    pairs = [(0, 0), (1, 1), (0, 1)]
    cols = base.numel // base.shape[0]
    stored = column_sums.fused_column_sums(base.stored(0, base.numel), agents, pairs, cols)
    decoded = column_sums.fused_column_sums(base.decoded, agents, pairs, cols)
    np.testing.assert_array_equal(stored, decoded)
    d = [v.reshape(-1, cols) for v in _reference_vectors(base.decoded, agents, 0)]
    for k, (i, j) in enumerate(pairs):
        want = [_fsum(d[i][:, c], d[j][:, c]) for c in range(cols)]
        assert columns.values(stored[k]) == want


def _params(name: str, n: int, extra: dict) -> dict:
    config = MergeConfig(
        base="b", tasks=tuple(f"t{i}" for i in range(n)), out="o", method=name,
        parameters=case_parameters(name) | extra,
    )  # fmt: skip
    return resolve_all(config, METHODS[name], ["w"])["w"]


CASES = [
    ("model_stock", {"filter_wise": False}), ("model_stock", {"filter_wise": True}),
    ("sce", {"select_topk": 1.0}), ("sce", {"select_topk": 0.5}), ("sce", {"select_topk": 0.13}),
    ("slerp", {}), ("nuslerp", {}),
    ("nuslerp", {"nuslerp_flatten": False, "nuslerp_row_wise": True}), ("karcher", {}),
    ("multislerp", {}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{sorted(c[1].items())}")
@pytest.mark.parametrize("budget", ["step", "whole"])
def test_every_chunk_fused_on_the_stored_form(base, case, budget):
    name, extra = case
    method = METHODS[name]
    n = task_count(name, 3)
    params = _params(name, n, extra)
    agents = bf16_agents(base, n, seed=13)
    step = base.step if budget == "step" else base.numel
    bounds = list(range(0, base.numel + 1, step))
    got = {mode: run_method(method, params, base, agents, bounds, mode)
           for mode in ("stored", "decoded", "eager")}  # fmt: skip
    rounds = sum(1 for totals in got["eager"].totals if totals) * (len(bounds) - 1)
    assert got["stored"].fused_rounds == got["decoded"].fused_rounds == rounds
    assert got["stored"].fused_merges == got["decoded"].fused_merges
    for mode in ("decoded", "eager"):
        assert got["stored"].merged == got[mode].merged, mode
        for mine, theirs in zip(got["stored"].totals, got[mode].totals, strict=True):
            assert mine.keys() == theirs.keys()
            for key in mine:
                np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{mode} {key}")


@pytest.mark.parametrize(
    ("name", "extra"),
    [("model_stock", {}), ("sce", {"select_topk": 1.0}), ("sce", {"select_topk": 0.5}),
     ("slerp", {}), ("nuslerp", {}), ("karcher", {}), ("multislerp", {})],
)  # fmt: skip
def test_the_fused_rounds_take_the_stored_form(name, extra):
    """Before the records' kernels these rounds declined a stored form (None), and the eager
    rule decoded it (sce's selection declined any input)."""
    base = _make("mxfp4")
    method = METHODS[name]
    n = task_count(name, 3)
    params = _params(name, n, extra)
    agents = bf16_agents(base, n, seed=14)
    state = method.initial_state({"w": params}, {"w": base.numel}, n)
    inputs = [base.stored(0, base.numel), *agents]
    got = method.fused_statistics(ChunkWork(Chunk("w", 0, base.shape), params, state, 0), inputs)
    assert got is not None


@pytest.mark.parametrize("start", [0, 65536 * 3 - 700])
def test_sce_s_selection_statistics_from_the_stored_form_are_topk_s(base, start):
    """sce's variance rounds from the stored form (`sce_numba.statistics`): each histogram
    is `topk`'s of the eager rule's variance keys (`sce.variance`, `magnitude_keys`) of the
    decoded copy, and the kept vectors' sums of squares the eager rule's, at a chunk that
    starts past an index bin (the index histograms' high and low parts)."""
    from ram_dist.kernels import sce_numba
    from ram_dist.methods.generalized_task_arithmetic import topk
    from ram_dist.methods.sce import variance

    agents = bf16_agents(base, 3, seed=15)
    stored = base.stored(0, base.numel)
    vectors = [torch.from_numpy(v) for v in _reference_vectors(base.decoded, agents, 0)]
    keys = topk.magnitude_keys(variance(vectors))
    numel = start + base.numel
    hist, nonzero = sce_numba.statistics(stored, agents, sce_numba.HIGH, size=topk.HIGH_BINS)
    np.testing.assert_array_equal(hist, topk.high_histogram(keys).numpy())
    assert nonzero == int((keys != 0).sum())
    threshold = int(keys.sort().values[base.numel // 2])
    high = threshold >> 16
    low, _ = sce_numba.statistics(stored, agents, sce_numba.LOW, size=topk.LOW_BINS,
                                  select_bin=high)  # fmt: skip
    np.testing.assert_array_equal(low, topk.low_histogram(keys, high).numpy())
    size = topk.index_bins(numel)
    index, _ = sce_numba.statistics(stored, agents, sce_numba.INDEX_HIGH, size=size,
                                    threshold=threshold, start=start)  # fmt: skip
    want = topk.index_high_histogram(keys, threshold, start, numel)
    np.testing.assert_array_equal(index, want.numpy())
    for index_bin in range(size):
        got, _ = sce_numba.statistics(
            stored, agents, sce_numba.INDEX_LOW, size=topk.LOW_BINS, threshold=threshold,
            start=start, select_bin=index_bin,
        )  # fmt: skip
        want = topk.index_low_histogram(keys, threshold, start, index_bin)
        np.testing.assert_array_equal(got, want.numpy())
    for cut in (None, start + base.numel // 3):
        squares, _ = sce_numba.statistics(
            stored, agents, sce_numba.SQUARES, threshold=threshold, index_cut=cut, start=start
        )
        keep = topk.keep_mask(keys, threshold, start, cut)
        want = torch.stack([exact_sums.product_sum(v * keep) for v in vectors])
        np.testing.assert_array_equal(squares, want.numpy())
        for t, v in enumerate(vectors):
            kept = (v * keep).numpy()
            assert exact_sums.value(squares[t]) == _fsum(kept, kept)
