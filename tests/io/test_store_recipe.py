"""docs/extending.md's "Adding a storage backend", carried out: a kind of store that is one
module (`toy_store`: a real fsspec filesystem, its client's errors with codes of its own,
and its `BACKEND` entry) joins the table with `register`, and is read, retried, classified
and explained with nothing else of ram-dist changed. The page names every field of the
entry."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
from safetensors.numpy import save
from toy_store import BACKEND, ToyError, ToyFileSystem

from ram_dist.errors import CheckpointError, StorageError
from ram_dist.io.backend import Backend, StoreErrors
from ram_dist.io.backends import BACKENDS, backend_of, register, unregister
from ram_dist.io.checkpoint import open_checkpoints
from ram_dist.io.failures import classify, is_storage_failure, storage_error, transient
from ram_dist.io.lease import OutputLease
from ram_dist.io.lease.best_effort import FsspecStore
from ram_dist.io.sinks import DriverSink, choose_sink
from ram_dist.io.storage import Storage

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick

EXTENDING = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
WEIGHTS = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.array([1.5, -2.0], dtype=np.float32),
}


@pytest.fixture
def toy() -> Iterator[None]:
    """The toy store known to fsspec and registered in the table, with one shelf."""
    fsspec.register_implementation("toy", ToyFileSystem, clobber=True)
    fsspec.register_implementation("toys", ToyFileSystem, clobber=True)
    ToyFileSystem.store.clear()
    ToyFileSystem.shelves = {"shelf"}
    ToyFileSystem.busy = 0
    register(BACKEND)
    try:
        yield
    finally:
        unregister(BACKEND)


def test_the_entry_joins_the_table_and_completes_its_options(toy: None) -> None:
    assert BACKENDS["toy"] is BACKEND
    assert backend_of("toy://shelf/m") is BACKEND and backend_of("toys://shelf/m") is BACKEND
    fs, path = Storage({"toy": {"colour": "red"}}).fs("toys://shelf/m")
    assert isinstance(fs, ToyFileSystem) and path == "/shelf/m"
    assert fs.storage_options == {"patience": 3, "colour": "red"}
    with pytest.raises(ValueError, match="taken"):
        register(BACKEND)


def test_it_is_gone_again_after_unregister(toy: None) -> None:
    unregister(BACKEND)
    assert "toy" not in BACKENDS and not is_storage_failure(ToyError("Busy", 503))
    register(BACKEND)
    assert is_storage_failure(ToyError("Busy", 503))


def test_a_checkpoint_there_is_opened_and_read_through_throttling(toy: None) -> None:
    fsspec.filesystem("toy").pipe_file("/shelf/base/model.safetensors", save(WEIGHTS))
    (base,) = open_checkpoints([("toy://shelf/base", "base")], Storage())
    assert set(base.tensors) == {"a", "b"}
    info = base.tensors["a"]
    url = "toy://shelf/base/model.safetensors"
    ToyFileSystem.busy = 2  # throttled twice: `retried_here` has `Storage` try again
    (data,) = Storage().read_ranges([(url, info.start, info.end)])
    assert bytes(data) == WEIGHTS["a"].tobytes() and ToyFileSystem.busy == 0


def test_a_missing_shelf_is_a_url_to_fix_and_a_missing_folder_is_no_checkpoint(
    toy: None,
) -> None:
    with pytest.raises(StorageError, match="shelf nowhere does not exist") as missing:
        open_checkpoints([("toy://nowhere/base", "base")], Storage())
    assert missing.value.exit_status == 2 and "create the shelf" in str(missing.value)
    with pytest.raises(CheckpointError, match="no checkpoint folder at toy://shelf/none"):
        open_checkpoints([("toy://shelf/none", "base")], Storage())


@pytest.mark.parametrize(
    ("code", "status", "kind", "exit_status", "words"),
    [
        ("NoSuchItem", 404, "missing", 2, "no such file (NoSuchItem: gone)"),
        ("Forbidden", 403, "denied", 2, "permission denied (Forbidden: gone)"),
        ("StaleBadge", 401, "credentials", 2, "the credentials have expired"),
        ("BadBadge", 401, "credentials", 2, "check the credentials the job runs with ("),
        ("Busy", 503, "throttled", 1, "still throttling requests after its retries"),
        ("Broken", 500, "server", 1, "the store failed after its retries"),
        ("Odd", 418, "other", 1, "Odd"),
    ],
)
def test_its_errors_are_told_by_its_own_codes(
    toy: None, code: str, status: int, kind: str, exit_status: int, words: str
) -> None:
    error = ToyError(code, status, "gone")
    wrapped = OSError(5, "Input/output error")
    wrapped.__cause__ = error  # as a client translates its own error
    for e in (error, wrapped):
        assert is_storage_failure(e) and classify(e).kind == kind
        assert transient(e) == (kind in ("throttled", "server"))
        err = storage_error(e, "toy://shelf/in/model.safetensors", "read", "input")
        assert err.exit_status == exit_status and words in str(err), str(err)
    if code == "BadBadge":
        assert "toy: a badge" in str(err)


def test_its_output_gets_the_default_lease_and_sink(toy: None) -> None:
    lease = OutputLease("toy://shelf/out", Storage(), "job")
    assert type(lease._store) is FsspecStore
    sink = choose_sink("toy://shelf/out", Storage(), shared=False, single_node=True)
    assert type(sink) is DriverSink


def test_the_page_names_every_field_of_the_entry() -> None:
    text = EXTENDING.read_text()
    section = text[text.index("## Adding a storage backend") :]
    section = section[: section.index("\n## ", 1)]
    named = set(re.findall(r"`([a-z_]+)(?:\(e\))?`", section))
    fields = {f.name for c in (Backend, StoreErrors) for f in dataclasses.fields(c)}
    assert fields <= named, sorted(fields - named)
