"""`LoraSource` and `LoraBiasSource` through the engine's reader: the rows' factors read per
block and the shared factor once per unit, the values the same whatever the split, and
the task's tensors the adapter leaves alone read once, for the base (`BaseValues`)."""

from __future__ import annotations

import numpy as np
import pytest

from ram_dist.engine import blocks, worker
from ram_dist.io.storage import Storage
from ram_dist.kernels import lora
from ram_dist.planning.layout import Layout, TensorEntry
from ram_dist.planning.lora_sources import LoraBiasSource, LoraSource
from ram_dist.planning.sources import BaseValues, Source
from ram_dist.planning.units import Piece

ROWS, COLS, R = 12, 10, 3


def _expected(base: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float, transposed: bool):
    """The spec's rule on whole tensors: float32 steps, k ascending, then bf16."""
    p = np.zeros((ROWS, COLS), np.float32)
    for i in range(ROWS):
        for j in range(COLS):
            # W[i, j]: (B @ A)[i, j], or (B @ A)[j, i] when transposed
            terms = [b[j, k] * a[k, i] if transposed else b[i, k] * a[k, j] for k in range(R)]
            acc = np.float32(terms[0])
            for t in terms[1:]:
                acc = np.float32(acc + np.float32(t))
            p[i, j] = acc
    value = base.reshape(ROWS, COLS) + np.float32(scale) * p
    return lora.cast(value.reshape(-1), "BF16", np.empty(ROWS * COLS * 2, np.uint8)).copy()


def _stream(layout: Layout, pieces: tuple[Piece, ...], inputs: int) -> tuple[list, list[int]]:
    read = [0] * inputs
    with worker.worker_context().work() as scope:
        got = [
            (b, [x.tobytes() for x in inputs_.raw], inputs_.dtypes)
            for b, inputs_ in blocks.BlockStream(pieces, layout, Storage(), read, scope)
        ]
    return got, read


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(("block", "cut"), [(7, 0), (20, 35), (1000, 60)])
def test_values_do_not_depend_on_blocks_or_units(tmp_path, monkeypatch, transposed, block, cut):
    """A weight [12, 10] of a bf16 base and a LoRA task (A and B in float32), read as two
    units cut at element `cut`, in compute blocks of `block` elements: the task's values are
    the whole-tensor rule's, and the shared factor is read once per unit."""
    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", block)
    rng = np.random.default_rng(1)
    base_f32 = lora.as_float32(
        lora.cast(rng.standard_normal(ROWS * COLS).astype(np.float32), "BF16",
                  np.empty(ROWS * COLS * 2, np.uint8)).copy(), "BF16")  # fmt: skip
    base = lora.cast(base_f32, "BF16", np.empty(ROWS * COLS * 2, np.uint8)).copy()
    fan_in, fan_out = (ROWS, COLS) if transposed else (COLS, ROWS)
    a = rng.standard_normal((R, fan_in)).astype(np.float32)
    b = rng.standard_normal((fan_out, R)).astype(np.float32)
    path = tmp_path / "data.bin"
    path.write_bytes(base.tobytes() + b.tobytes() + a.tobytes())
    url = str(path)
    b_at, a_at = base.size, base.size + b.nbytes
    src = LoraSource(url, b_at, "F32", a_at, "F32", R, ROWS, COLS, 0.75, transposed, "BF16", "BF16")
    entry = TensorEntry("w", (ROWS, COLS), True, "BF16", (Source(url, 0, "BF16"), src))
    layout = Layout({"w": entry}, {"model.safetensors": ("w",)}, False)
    want = _expected(base_f32, a, b, 0.75, transposed)
    units = (
        [(Piece("w", 0, cut),), (Piece("w", cut, ROWS * COLS),)]
        if cut
        else [(Piece("w", 0, ROWS * COLS),)]
    )
    values, shared_reads = b"", 0
    for pieces in units:
        got, read = _stream(layout, pieces, 2)
        for _, raw, dtypes in got:
            assert dtypes == ("BF16", "BF16")
            values += raw[1]
        shared_reads += 1
        start, stop = pieces[0].start, pieces[0].stop
        first, last = start // COLS, -(-stop // COLS)
        blocks_ = len(got)
        # per block the rows' factors (rows may repeat across blocks), once the shared one
        shared = R * (COLS if not transposed else COLS) * 4
        assert read[1] >= shared + (last - first) * R * 4
        assert read[1] <= shared + blocks_ * (last - first) * R * 4
    assert values == want.tobytes()


def test_a_tensor_the_adapter_leaves_alone_is_read_once(tmp_path):
    """`BaseValues`: nothing read for the task, its values the base's bytes; small tensors
    stay grouped into one request."""
    data = np.arange(40, dtype=np.float32)
    path = tmp_path / "base.bin"
    path.write_bytes(data.tobytes())
    entry = TensorEntry("n", (40,), True, "F32", (Source(str(path), 0, "F32"), BaseValues("F32")))
    layout = Layout({"n": entry}, {"model.safetensors": ("n",)}, False)
    got, read = _stream(layout, (Piece("n", 4, 30),), 2)
    assert read == [26 * 4, 0]
    [(_, raw, dtypes)] = got
    assert raw[0] == raw[1] == data[4:30].tobytes() and dtypes == ("F32", "F32")
    assert layout.read_bytes("n", 10) == 40


def test_a_lora_bias_is_the_base_bias_plus_the_scaled_lora_bias(tmp_path):
    bias = np.array([1.5, -2.25, 3.0, 0.1], np.float32)
    lb = np.array([0.5, 0.125, -1.0, 2.0], np.float32)
    path = tmp_path / "data.bin"
    path.write_bytes(bias.tobytes() + lb.tobytes())
    src = LoraBiasSource(str(path), 16, "F32", 0.5, "F32", "BF16")
    entry = TensorEntry("b", (4,), True, "BF16", (Source(str(path), 0, "F32"), src))
    layout = Layout({"b": entry}, {"model.safetensors": ("b",)}, False)
    [(_, raw, dtypes)] = _stream(layout, (Piece("b", 0, 4),), 2)[0]
    want = lora.cast(bias + np.float32(0.5) * lb, "BF16", np.empty(8, np.uint8))
    assert raw[1] == want.tobytes() and dtypes == ("F32", "BF16")


def test_planned_bytes_per_element_are_the_rows_factors_rounded_up():
    src = LoraSource("f", 0, "F32", 0, "BF16", 16, 4096, 2048, 1.0, False, "BF16", "BF16")
    assert src.itemsize == 1  # 16 * 4 bytes of B per 2048-element row
    assert src.unit_ranges() == [("f", 0, 16 * 2048 * 2)]  # A, once per unit
    assert src.ranges(2048 * 3, 2048 * 5) == [("f", 3 * 64, 5 * 64)]
    emb = src._replace(transposed=True)
    assert emb.ranges(2048 * 3, 2048 * 5)[:2] == [("f", 6, 10), ("f", 4096 * 2 + 6, 4096 * 2 + 10)]
    assert len(emb.ranges(0, 2048)) == 16 and emb.unit_ranges() == [("f", 0, 16 * 2048 * 4)]
