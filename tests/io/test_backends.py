"""The backend table: every entry names what exists, and a protocol (or its alias) gets the
lease store and output sink meant for it."""

from __future__ import annotations

from typing import Any

import pytest

from ram_dist.io.backends import BACKENDS, DEFAULT, backend, backend_of, load
from ram_dist.io.lease import OutputLease
from ram_dist.io.lease.best_effort import FsspecStore
from ram_dist.io.lease.local import LocalStore
from ram_dist.io.lease.store import LeaseStore
from ram_dist.io.sinks import DriverSink, FileSink, OutputSink, choose_sink
from ram_dist.io.storage import Storage

#: In the quick tier (`pytest -m quick`).
pytestmark = pytest.mark.quick


@pytest.mark.parametrize("protocol", sorted(BACKENDS) + ["<default>"])
def test_every_entry_names_a_lease_store_and_a_sink(protocol: str) -> None:
    entry = DEFAULT if protocol == "<default>" else BACKENDS[protocol]
    assert issubclass(load(entry.lease), LeaseStore)
    assert issubclass(load(entry.sink), OutputSink)
    for name in entry.client_errors:
        try:
            assert issubclass(load(name), BaseException)
        except ImportError:
            pass  # that client is not installed here


def test_aliases_and_unknown_protocols() -> None:
    assert backend("s3a") is BACKENDS["s3"] and backend("gcs") is BACKENDS["gs"]
    assert backend("no-such-store") is DEFAULT
    assert backend_of("/some/path") is BACKENDS["file"]
    assert backend_of("s3a://bucket/key") is BACKENDS["s3"]


@pytest.mark.parametrize(
    ("url", "store", "sink"),
    [
        ("{tmp}/out", LocalStore, FileSink),
        ("file://{tmp}/out", LocalStore, FileSink),
        ("memory://ram-dist-backends/out", FsspecStore, DriverSink),
    ],
)
def test_a_location_gets_its_backends_lease_and_sink(
    tmp_path: Any, url: str, store: type, sink: type
) -> None:
    url = url.format(tmp=tmp_path)
    lease = OutputLease(url, Storage(), "job")
    assert type(lease._store) is store
    assert type(choose_sink(url, Storage(), shared=False, single_node=True)) is sink


@pytest.mark.parametrize("url", ["s3://bkt/out", "gs://bkt/out", "az://box/out"])
def test_a_store_s_sink_is_chosen_for_the_reason_it_gives(url: str) -> None:
    kind = load(backend_of(url).sink)
    sink = kind.choose(url, Storage(), shared=False, single_node=None)
    assert type(sink) is kind and sink.reason == kind.chosen and sink.reason
