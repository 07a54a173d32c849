"""The `TensorSource` protocol's implementations, plain dtypes and FP8 blocks (LoRA's are
tested in test_lora_sources.py): the ranges a unit reads, the values they decode to, the bytes
the planner counts and the rows it never cuts; every source a tuple; and a made-up format,
made as docs/extending.md says, planned and read through the same seam."""

from __future__ import annotations

import pickle
import re
from typing import NamedTuple

import numpy as np
import pytest

from ram_dist.kernels import fp8
from ram_dist.planning.layout import Layout, TensorEntry
from ram_dist.planning.sources import (
    FP8_VALUES_DTYPE,
    Fp8Source,
    Source,
    SourceDefaults,
    TensorSource,
)
from ram_dist.planning.units import plan_units

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _values(read: list[np.ndarray], source: TensorSource, start: int, stop: int) -> np.ndarray:
    return source.decode(start, stop, read, lambda n: np.empty(n, dtype=np.float32), read[0])


def test_a_plain_source_reads_its_elements_and_they_are_its_values():
    src: TensorSource = Source("f", 100, "BF16")
    assert src.ranges(3, 10) == [("f", 106, 120)]
    got = (src.itemsize, src.values_dtype, src.decoded, src.atomic_rows)
    assert got == (2, "BF16", False, None)
    raw = np.arange(14, dtype=np.uint8)
    assert _values([raw], src, 3, 10) is raw


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16"])
def test_an_fp8_source_reads_whole_bands_and_their_scale_rows(scale_dtype):
    rows, cols, block = 5, 6, (2, 4)
    src: TensorSource = Fp8Source("w", 1000, "F8_E4M3", "s", 50, scale_dtype, block, cols)
    width = 4 if scale_dtype == "F32" else 2
    assert (src.itemsize, src.values_dtype, src.decoded, src.atomic_rows) == (
        1, FP8_VALUES_DTYPE, True, 2,
    )  # fmt: skip
    band = block[0] * cols
    # bands 1 and 2 (the last one ragged): their e4m3 bytes, then 2 scales per band
    assert src.ranges(band, rows * cols) == [
        ("w", 1000 + band, 1000 + rows * cols),
        ("s", 50 + 1 * 2 * width, 50 + 3 * 2 * width),
    ]
    with pytest.raises(AssertionError):
        src.ranges(1, band)
    rng = np.random.default_rng(0)
    q = rng.integers(0, 0x7E, rows * cols, dtype=np.uint8)
    scales = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)
    raw_scales = fp8.scale_bytes(scales.reshape(-1), scale_dtype)
    values = _values([q, raw_scales], src, 0, rows * cols).view(np.float32)
    stored = fp8.scale_values(raw_scales, scale_dtype).reshape(3, 2)
    want = (
        fp8.E4M3_VALUES[q].reshape(rows, cols)
        * np.repeat(np.repeat(stored, 2, axis=0)[:rows], 4, axis=1)[:, :cols]
    )
    assert values.tobytes() == want.astype(np.float32).tobytes()


class _HalvesFields(NamedTuple):
    file: str
    start: int
    dtype: str = "F16"


class _Halves(_HalvesFields, SourceDefaults):
    """A made-up format, as docs/extending.md's recipe makes one: F16 elements (the default
    `itemsize`, 2) that read a second range, decoded to F32, and rows in pairs; no unit
    ranges, and no stored form a kernel reads (the defaults: the values are decoded first)."""

    __slots__ = ()

    values_dtype = "F32"
    decoded = True
    atomic_rows = 2

    def ranges(self, start: int, stop: int) -> list[tuple[str, int, int]]:
        return [(self.file, self.start + 2 * start, self.start + 2 * stop), (self.file, 0, 4)]

    def decode(self, start, stop, read, floats, base):
        out = floats(stop - start)
        out[:] = read[0].view(np.float16) * read[1].view(np.float32)[0]
        return out.view(np.uint8)


def test_a_new_format_says_only_what_differs_from_the_defaults():
    """What `_Halves` leaves out is the base's: a plain tensor's bytes per element, no unit
    ranges, no stored form."""
    src: TensorSource = _Halves("t", 8)
    assert (src.itemsize, src.unit_ranges(), src.encoded(0, 2, [])) == (2, [], None)
    assert (src.values_dtype, src.decoded, src.atomic_rows) == ("F32", True, 2)


def test_every_source_is_a_tuple_without_a_dict():
    """Each implementation (and the made-up one) is its fields' NamedTuple with the defaults
    and empty `__slots__`: no `__dict__` per source, pickled as its fields alone."""
    import ram_dist.planning.lora_sources  # noqa: F401  (its classes, as subclasses)
    import ram_dist.planning.packed_sources  # noqa: F401

    classes = SourceDefaults.__subclasses__()
    assert len(classes) >= 8
    for cls in classes:
        assert issubclass(cls, tuple) and cls.__dict__.get("__slots__") == (), cls
        src = cls(*[0] * len(cls._fields))
        assert not hasattr(src, "__dict__"), cls
        again = pickle.loads(pickle.dumps(src))
        assert type(again) is cls and tuple(again) == tuple(src), cls


def test_the_planner_asks_only_the_protocol():
    """A tensor of a new format is planned by its bytes per element and its atomic rows:
    no field of the layout names the format."""
    src: TensorSource = _Halves("t", 8)
    entry = TensorEntry("w", (6, 5), True, "F16", (Source("b", 0, "F16"), src))
    layout = Layout({"w": entry}, {"model.safetensors": ("w",)}, False)
    assert entry.atomic_rows == 2 and entry.band == 10
    assert layout.read_bytes("w", 3) == 3 * (2 + 2)
    units = plan_units(layout.slots(), budget_bytes=2 * 5 * 3)  # 3 rows of one input
    cuts = [p.start for u in units for p in u.pieces]
    assert cuts == [0, 10, 20]  # two rows at a time, never one and a half bands


def test_the_reader_decodes_a_new_format_through_the_seam(tmp_path, monkeypatch):
    """The engine's reader streams a tensor of the made-up format: blocks of whole atomic
    rows, each input's ranges read and counted, its values decoded, what was read kept."""
    from ram_dist.engine import blocks, worker
    from ram_dist.io.storage import Storage
    from ram_dist.planning.units import Piece

    monkeypatch.setattr(blocks, "COMPUTE_BLOCK", 13)  # cut at 10, a band, not at 13
    base = np.arange(30, dtype=np.float16)
    task = np.arange(30, dtype=np.float16) - 7
    path = tmp_path / "data.bin"
    path.write_bytes(np.float32(3).tobytes() + bytes(4) + task.tobytes() + base.tobytes())
    url = str(path)
    entry = TensorEntry("w", (6, 5), True, "F16", (Source(url, 68, "F16"), _Halves(url, 8)))
    layout = Layout({"w": entry}, {"model.safetensors": ("w",)}, False)
    read = [0, 0]
    with worker.worker_context().work() as scope:
        got = [
            (b, inputs.raw[0].tobytes(), inputs.raw[1].tobytes(), inputs.dtypes, inputs.stored)
            for b, inputs in blocks.BlockStream(
                (Piece("w", 10, 30),), layout, Storage(), read, scope
            )
        ]
    assert [(b.lo, b.hi) for b, *_ in got] == [(0, 10), (10, 20)]
    for block, base_bytes, values, dtypes, stored in got:
        lo, hi = 10 + block.lo, 10 + block.hi
        assert base_bytes == base[lo:hi].tobytes()
        assert values == (task[lo:hi].astype(np.float32) * 3).tobytes()
        assert dtypes == ("F16", "F32")
        assert stored[0] is None and stored[1][0].tobytes() == task[lo:hi].tobytes()
    assert read == [40, 40 + 2 * 4]  # each block read the factor again


def test_the_extending_page_names_every_member_and_implementation():
    """docs/extending.md's "Adding an input format" names each member of `TensorSource` and
    each implementation in ram_dist (a new one, or a new member, is a line of the page)."""
    import inspect
    from pathlib import Path

    import ram_dist.planning.lora_sources  # noqa: F401  (its classes, as subclasses)
    import ram_dist.planning.packed_sources  # noqa: F401

    root = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
    page = (root / "docs" / "extending.md").read_text()
    section = page.split("## Adding an input format")[1].split("\n## ")[0]
    members = [n for n, _ in inspect.getmembers(TensorSource) if not n.startswith("_")]
    assert {"file", "decode", "encoded", "unit_ranges"} <= set(members)
    named = set(re.findall(r"`(\w+)", section))
    assert set(members) <= named, set(members) - named
    classes = [c.__name__ for c in SourceDefaults.__subclasses__() if c.__module__ != __name__]
    assert len(classes) == 7 and set(classes) <= named, set(classes) - named
