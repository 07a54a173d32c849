"""The header parser against files written by safetensors itself, and against broken ones."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from ram_dist.errors import CheckpointError
from ram_dist.io.header_reads import read_file_headers
from ram_dist.io.storage import Storage

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


def _write_raw(path, header: object, data: bytes = b"") -> str:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def test_offsets_match_safetensors_own_layout(tmp_path):
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.tensor(7, dtype=torch.int64),
        "c": torch.arange(5, dtype=torch.bfloat16),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header, identity = read_file_headers([str(path)], Storage())[0]
    raw = path.read_bytes()
    assert header.metadata == {"format": "pt"}
    assert identity["size"] == path.stat().st_size and identity["version"].startswith("mtime:")
    for name, t in tensors.items():
        info = header.tensors[name]
        assert info.shape == tuple(t.shape)
        assert raw[info.start : info.end] == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert header.tensors["c"].dtype == "BF16"
    assert header.tensors["b"].shape == ()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x01\x00", "shorter than 8 bytes"),
        (struct.pack("<Q", 10**12), "exceeds the"),
        (struct.pack("<Q", 50) + b"{}", "runs past the end"),
        (struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
    ],
)
def test_broken_prefix_or_json(tmp_path, raw, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=message) as e:
        read_file_headers([str(path)], Storage())[0]
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype 'Q7'"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}, "shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 6]}, "needs 8"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "truncated"),
    ],
)
def test_bad_tensor_entries_name_file_and_tensor(tmp_path, entry, message):
    path = _write_raw(tmp_path / "bad.safetensors", {"w": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=message) as e:
        read_file_headers([path], Storage())[0]
    assert "bad.safetensors" in str(e.value)
    if "truncated" not in message:
        assert "'w'" in str(e.value)


def test_overlapping_tensors_are_refused(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    path = _write_raw(tmp_path / "x.safetensors", header, b"\0" * 12)
    with pytest.raises(CheckpointError, match="overlaps"):
        read_file_headers([path], Storage())[0]


GOOD = {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}


@pytest.mark.parametrize(
    "entry",
    [
        GOOD,
        {**GOOD, "shape": []},
        {**GOOD, "shape": [0, 3], "data_offsets": [8, 8]},
        {**GOOD, "extra": 1},
        [1, 2],
        {**GOOD, "dtype": "Q7"},
        {**GOOD, "dtype": 4},
        {**GOOD, "shape": [2, True]},
        {**GOOD, "shape": [2, -3]},
        {**GOOD, "shape": [2, 3.0]},
        {**GOOD, "shape": "23"},
        {**GOOD, "data_offsets": [8]},
        {**GOOD, "data_offsets": [8, 32, 40]},
        {**GOOD, "data_offsets": [False, 24]},
        {**GOOD, "data_offsets": [-8, 16]},
        {**GOOD, "data_offsets": [32, 8]},
        {**GOOD, "data_offsets": [8, 30]},
        {**GOOD, "data_offsets": (8, 32)},
        {"shape": [2, 3], "data_offsets": [8, 32]},
    ],
)
def test_quick_check_of_an_entry_agrees_with_the_full_one(entry):
    """The parser's quick path takes only entries the full check takes, with the same result;
    anything else goes to the full check, which says what is wrong."""
    from ram_dist.io.safetensors_header import _tensor_info, _well_formed

    quick = _well_formed("w", entry, "f", 100)
    try:
        full = _tensor_info("w", entry, "f", 100)
    except CheckpointError:
        assert quick is None
    else:
        assert quick is None or quick == full
        assert entry is not GOOD or quick == full


def test_index_naming_a_tensor_no_file_holds_is_refused(tmp_path):
    from ram_dist.io.checkpoint import INDEX_NAME, open_checkpoints
    from ram_dist.synthetic.files import write_sparse_checkpoint

    write_sparse_checkpoint(tmp_path, [[("a", (4,)), ("b", (2,))], [("c", (3,))]])
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    open_checkpoints([(str(tmp_path), "base")], Storage())[0]  # as written: fine
    index["weight_map"] |= {"zz": "model-00002-of-00002.safetensors", "d": index["weight_map"]["a"]}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="index maps 'd' to model-00001-of-00002.safe"):
        open_checkpoints([(str(tmp_path), "base")], Storage())[0]
