"""Property: for any bytes and any JSON, the header reader returns a valid header or raises the
project's own error; it never crashes otherwise and never reads past its cap."""

from __future__ import annotations

import json
import struct
import tracemalloc
import uuid

import fsspec
from hypothesis import given, settings
from hypothesis import strategies as st

from ram_dist.errors import CheckpointError
from ram_dist.io.header_reads import read_file_headers
from ram_dist.io.safetensors_header import MAX_HEADER_BYTES
from ram_dist.io.storage import Storage

STORAGE = Storage()
MEMORY = fsspec.filesystem("memory")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "BOOL", "X9"]) | json_values,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 300), min_size=0, max_size=3) | json_values,
    },
)
headers = st.dictionaries(st.text(max_size=6), entries | json_values, max_size=4)


def _read(data: bytes):
    path = f"memory://fuzz/{uuid.uuid4().hex}.safetensors"
    MEMORY.pipe_file(path, data)
    try:
        header, identity = read_file_headers([path], STORAGE)[0]
    except CheckpointError:
        return None
    finally:
        MEMORY.rm(path)
    # What is returned is consistent: every tensor lies inside the file, without overlaps.
    spans = sorted((t.start, t.end) for t in header.tensors.values())
    assert all(0 <= a <= b <= identity["size"] for a, b in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))
    return header


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes(data):
    _read(data)


@settings(max_examples=300, deadline=None)
@given(headers, st.binary(max_size=300))
def test_arbitrary_json_headers(header, tail):
    body = json.dumps(header).encode()
    _read(struct.pack("<Q", len(body)) + body + tail)


@settings(max_examples=100, deadline=None)
@given(json_values, st.integers(0, 2**64 - 1))
def test_arbitrary_json_and_lengths(value, length):
    _read(struct.pack("<Q", length) + json.dumps(value).encode())


def test_a_header_bomb_allocates_nothing_near_its_claim():
    """A file claiming a header just under the cap (and one far over it) is refused from its
    size, before any allocation of that size."""
    for claim in (MAX_HEADER_BYTES - 8, 2**63):
        tracemalloc.start()
        assert _read(struct.pack("<Q", claim) + b"{}" * 10) is None
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 2**20
