"""The output lease on a local folder, on a real S3 server (moto over HTTP) and on the GCS
emulator (over HTTP, behind the test server's preconditions): one writer at a time, dead and
stale holders taken over, renewals, losing the lease, races."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import gcs_server
import pytest
from lease_cases import (  # noqa: F401  (every store's tests, run with this module's `loc`)
    HOST,
    Location,
    foreign,
    test_context_manager_releases_on_exception,
    test_dead_process_on_this_host_is_taken_over_at_once,
    test_lost_when_someone_else_replaces_or_removes_the_lease,
    test_other_host_refused_while_fresh_taken_over_when_stale,
    test_racing_acquirers_exactly_one_wins,
    test_racing_takers_of_a_stale_lease_exactly_one_wins,
    test_renew_thread_updates_renewed,
    test_second_acquirer_refused_then_release_and_reacquire,
    test_unreadable_lease_counts_as_an_unknown_holder,
)
from s3_server import bucket_fs, running_server, storage_options

from ram_dist.io.lease import LEASE_NAME, Holder, LeaseHeld, OutputLease
from ram_dist.io.lease.host import machine_id, process_start
from ram_dist.io.storage import Storage, join

BUCKET = "leases"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    with running_server() as srv:
        options = storage_options(srv)
        bucket_fs(options, BUCKET)
        yield options


@pytest.fixture(scope="module")
def gcs() -> Iterator[dict[str, Any]]:
    with gcs_server.running_gcs_server():
        options = gcs_server.storage_options()
        gcs_server.bucket_fs(options, BUCKET)
        yield options


def make_location(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> Location:
    if kind == "local":
        out = str(tmp_path / "merged")
        storage = Storage()
    elif kind == "s3":
        options = request.getfixturevalue("s3")
        out = f"s3://{BUCKET}/{uuid.uuid4().hex}/merged"
        storage = Storage(options)
    elif kind == "gcs":
        options = request.getfixturevalue("gcs")
        out = f"gs://{BUCKET}/{uuid.uuid4().hex}/merged"
        storage = Storage(options)
    else:
        out = f"memory://lease-{uuid.uuid4().hex}/merged"
        storage = Storage()
    fs, path = storage.fs(join(out, LEASE_NAME))
    return Location(kind, out, storage, fs, path)


@pytest.fixture(params=["local", "s3", "gcs"])
def loc(request: pytest.FixtureRequest, tmp_path: Any) -> Location:
    return make_location(request.param, tmp_path, request)


def test_holder_json_round_trip_and_junk() -> None:
    h = Holder("job-1", "host-a", 42, 1.5, 2.5, "boot/pid:[1]")
    assert Holder.from_json(h.to_json()) == h
    assert Holder.from_json(h.to_json().encode()) == h
    legacy = {"job": "j", "host": "h", "pid": 1, "started": 1, "renewed": 2}
    assert Holder.from_json(json.dumps(legacy)) == Holder("j", "h", 1, 1.0, 2.0)
    for junk in ("[]", "{}", '{"job": 1}', json.dumps({**legacy, "pid": True}), "nan", "{"):
        with pytest.raises(ValueError):
            Holder.from_json(junk)


def test_local_acquire_creates_the_output_folder(tmp_path: Any) -> None:
    out = tmp_path / "a" / "b"
    lease = OutputLease(str(out), Storage(), "job")
    assert lease.acquire() is None
    holder = Holder.from_json((out / LEASE_NAME).read_text())
    assert (holder.job, holder.host, holder.pid) == ("job", HOST, os.getpid())
    lease.release()
    assert out.is_dir() and not (out / LEASE_NAME).exists()


def test_reused_pid_on_this_host_counts_as_gone(tmp_path: Any) -> None:
    """The pid is alive but its process started after the lease was taken."""
    loc = Location("local", str(tmp_path), Storage(), *Storage().fs(str(tmp_path / LEASE_NAME)))
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as proc:
        try:
            now = time.time()
            machine = machine_id()
            loc.write(Holder("old", HOST, proc.pid, now - 3600, now, machine))
            lease = loc.lease("new")
            if process_start(proc.pid) is None:
                pytest.skip("no /proc start times here")
            assert "no longer exists" in lease.acquire()
            lease.release()
            # The same live process, holding since before it started? No: since after.
            loc.write(Holder("live", HOST, proc.pid, time.time(), time.time(), machine))
            with pytest.raises(LeaseHeld, match="job live"):
                loc.lease("new").acquire()
        finally:
            proc.kill()


RACER = """
import os, sys, time
from ram_dist.io.lease import LeaseHeld, OutputLease
from ram_dist.io.storage import Storage
out, job, go, done = sys.argv[1:]
lease = OutputLease(out, Storage(), job, stale_after_s=10.0, renew_every_s=5.0)
while not os.path.exists(go):
    time.sleep(0.001)
try:
    lease.acquire()
    print("won", flush=True)
except LeaseHeld:
    print("held", flush=True)
while not os.path.exists(done):  # stay alive: a dead winner's lease is free at once
    time.sleep(0.005)
"""


@pytest.mark.parametrize("stale", [False, True])
def test_racing_processes_exactly_one_wins(tmp_path: Any, stale: bool) -> None:
    for rnd in range(2):
        out = tmp_path / f"out-{rnd}"
        out.mkdir()
        if stale:
            (out / LEASE_NAME).write_text(foreign(age=30.0).to_json())
        go, done = tmp_path / f"go-{rnd}", tmp_path / f"done-{rnd}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, str(out), f"proc-{i}", str(go), str(done)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(4)
        ]
        try:
            time.sleep(0.3)  # let them start up and wait for the signal
            go.touch()
            results = [p.stdout.readline().strip() for p in procs]
        finally:
            done.touch()
            for p in procs:
                p.wait(timeout=30)
                p.stdout.close()
        assert sorted(results) == ["held", "held", "held", "won"], results
        assert sorted(os.listdir(out)) == [LEASE_NAME]  # no guard or temporary file left


def test_best_effort_store(request: pytest.FixtureRequest, tmp_path: Any) -> None:
    """memory:// (no conditional create): check, write, read back."""
    loc = make_location("memory", tmp_path, request)
    a = loc.lease("job-a")
    assert a.acquire() is None
    with pytest.raises(LeaseHeld, match="job job-a"):
        loc.lease("job-b").acquire()
    a.release()
    assert loc.holder() is None
    loc.write(foreign(age=10.0))
    b = loc.lease("job-b", stale_after_s=1.0, renew_every_s=0.5)
    assert re.search(r"not renewed for \d+ s$", b.acquire())
    b.release()
    assert loc.holder() is None


def test_bad_timings_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="shorter"):
        OutputLease(str(tmp_path), Storage(), "job", stale_after_s=1.0, renew_every_s=1.0)
