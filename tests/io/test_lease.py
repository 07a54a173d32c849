"""The output lease on a local folder, on a real S3 server (moto over HTTP) and on the GCS
emulator (over HTTP, behind the test server's preconditions): one writer at a time, dead and
stale holders taken over, renewals, losing the lease, races."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gcs_server
import pytest
from s3_server import bucket_fs, running_server, storage_options

from ram_dist.errors import RamDistError
from ram_dist.io import lease as lease_mod
from ram_dist.io.lease import LEASE_NAME, Holder, LeaseHeld, OutputLease
from ram_dist.io.lease.host import machine_id, process_start
from ram_dist.io.storage import Storage, join

BUCKET = "leases"
HOST = socket.gethostname()


@dataclass
class Location:
    """A fresh output location and raw access to its lease, as another party would have."""

    kind: str
    out: str
    storage: Storage
    fs: Any
    path: str  # the lease's path inside `fs`

    @property
    def url(self) -> str:
        return join(self.out, LEASE_NAME)

    def lease(self, job: str, **kw: float) -> OutputLease:
        return OutputLease(self.out, self.storage, job, **kw)

    def write(self, data: bytes | Holder) -> None:
        if isinstance(data, Holder):
            data = data.to_json().encode()
        if self.kind == "local":
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fs.pipe_file(self.path, data)
        self.fs.invalidate_cache()

    def holder(self) -> Holder | None:
        self.fs.invalidate_cache()
        if not self.fs.exists(self.path):
            return None
        return Holder.from_json(self.fs.cat_file(self.path))

    def delete(self) -> None:
        self.fs.rm_file(self.path)
        self.fs.invalidate_cache()


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


def foreign(job: str = "remote-job", *, age: float = 0.0, host: str = "other-host") -> Holder:
    """A lease of another host, last renewed `age` seconds ago."""
    now = time.time()
    return Holder(job, host, 999_999, now - age - 60, now - age)


def wait_for(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_holder_json_round_trip_and_junk() -> None:
    h = Holder("job-1", "host-a", 42, 1.5, 2.5, "boot/pid:[1]")
    assert Holder.from_json(h.to_json()) == h
    assert Holder.from_json(h.to_json().encode()) == h
    legacy = {"job": "j", "host": "h", "pid": 1, "started": 1, "renewed": 2}
    assert Holder.from_json(json.dumps(legacy)) == Holder("j", "h", 1, 1.0, 2.0)
    for junk in ("[]", "{}", '{"job": 1}', json.dumps({**legacy, "pid": True}), "nan", "{"):
        with pytest.raises(ValueError):
            Holder.from_json(junk)


def test_second_acquirer_refused_then_release_and_reacquire(loc: Location) -> None:
    a = loc.lease("job-a")
    assert a.acquire() is None
    holder = loc.holder()
    assert holder is not None and holder.job == "job-a" and holder.pid == os.getpid()

    b = loc.lease("job-b")
    with pytest.raises(LeaseHeld) as held:
        b.acquire()
    message = str(held.value)
    assert isinstance(held.value, RamDistError)
    for part in ("job job-a", f"host {HOST}", f"pid {os.getpid()}", loc.url, "--overwrite"):
        assert part in message, (part, message)
    assert "stale" in message and "+00:00" in message  # UTC ISO times
    assert "secret" not in message and "endpoint" not in message

    a.release()
    assert loc.holder() is None
    a.release()  # idempotent
    c = loc.lease("job-c")
    c.acquire()
    loc.delete()
    c.release()  # a missing lease is fine
    assert b.acquire() is None
    assert loc.holder().job == "job-b"
    b.release()
    assert loc.holder() is None


def test_local_acquire_creates_the_output_folder(tmp_path: Any) -> None:
    out = tmp_path / "a" / "b"
    lease = OutputLease(str(out), Storage(), "job")
    assert lease.acquire() is None
    holder = Holder.from_json((out / LEASE_NAME).read_text())
    assert (holder.job, holder.host, holder.pid) == ("job", HOST, os.getpid())
    lease.release()
    assert out.is_dir() and not (out / LEASE_NAME).exists()


def test_dead_process_on_this_host_is_taken_over_at_once(loc: Location) -> None:
    """A process that took the lease and died without releasing it."""
    script = (
        "import json, os, sys\n"
        "from ram_dist.io.lease import OutputLease\n"
        "from ram_dist.io.storage import Storage\n"
        "OutputLease(sys.argv[1], Storage(json.loads(sys.argv[2])), 'crashed').acquire()\n"
        "os._exit(0)\n"
    )
    options = json.dumps({k: dict(v) for k, v in loc.storage.options.items()})
    proc = subprocess.run(
        [sys.executable, "-c", script, loc.out, options], capture_output=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr.decode()
    dead = loc.holder()
    assert dead is not None and dead.job == "crashed" and dead.host == HOST

    lease = loc.lease("job-b")  # default stale_after_s: the lease is fresh
    note = lease.acquire()
    assert note == (
        f"took over the lease of job crashed on host {HOST} (pid {dead.pid}): "
        "that process no longer exists"
    )
    assert lease.note == note
    assert loc.holder().job == "job-b"
    lease.release()


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


def test_other_host_refused_while_fresh_taken_over_when_stale(loc: Location) -> None:
    loc.write(foreign())  # pid 999999 does not exist here: irrelevant on another host
    lease = loc.lease("job-b", stale_after_s=3.0, renew_every_s=1.0)
    with pytest.raises(LeaseHeld) as held:
        lease.acquire()
    assert "job remote-job on host other-host (pid 999999)" in str(held.value)

    loc.write(foreign(age=10.0))
    note = lease.acquire()
    assert note is not None
    assert note.startswith("took over the lease of job remote-job on host other-host")
    assert int(re.fullmatch(r".*: not renewed for (\d+) s", note).group(1)) >= 10
    assert loc.holder().job == "job-b"
    lease.release()
    assert loc.holder() is None


def test_unreadable_lease_counts_as_an_unknown_holder(loc: Location) -> None:
    for junk in (b"{not json", b"x" * (lease_mod.MAX_LEASE_BYTES + 10)):
        loc.write(junk)
        with pytest.raises(LeaseHeld, match="cannot read") as held:
            loc.lease("job").acquire()
        assert loc.url in str(held.value)
    if loc.kind == "local":  # stale from its modification time
        old = time.time() - 1000
        os.utime(loc.path, (old, old))
        lease = loc.lease("job")
        note = lease.acquire()
        assert note is not None and note.startswith("took over an unreadable lease")
        lease.release()


def test_renew_thread_updates_renewed(loc: Location) -> None:
    lease = loc.lease("job", stale_after_s=5.0, renew_every_s=0.1)
    with lease:
        first = loc.holder()
        later = wait_for(lambda: (h := loc.holder()) and h.renewed > first.renewed + 0.15 and h)
        assert later.started == first.started and later.job == "job"
        assert lease.lost is None
    assert loc.holder() is None
    assert lease.lost is None
    if loc.kind == "local":  # no guard or temporary file left behind
        assert os.listdir(loc.out) == []


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_lost_when_someone_else_replaces_or_removes_the_lease(loc: Location, how: str) -> None:
    lease = loc.lease("job", stale_after_s=5.0, renew_every_s=0.1)
    with lease:
        if how == "replaced":
            loc.write(foreign("intruder"))
        else:
            loc.delete()
        lost = wait_for(lambda: lease.lost)
        assert loc.url in lost
        if how == "replaced":
            assert "job intruder on host other-host" in lost
        else:
            assert "removed" in lost
    # Release left the other's lease alone.
    after = loc.holder()
    assert (after.job if after else None) == ("intruder" if how == "replaced" else None)


def test_context_manager_releases_on_exception(loc: Location) -> None:
    lease = loc.lease("job", renew_every_s=0.05, stale_after_s=5.0)
    with pytest.raises(KeyError, match="boom"), lease:
        assert loc.holder().job == "job"
        raise KeyError("boom")
    assert loc.holder() is None
    with loc.lease("next") as again:
        assert again.note is None and loc.holder().job == "next"
    assert loc.holder() is None


def race(loc: Location, n: int, **kw: float) -> tuple[list[str], list[str]]:
    """`n` threads acquire at once: the jobs that won, and the messages of those refused."""
    barrier = threading.Barrier(n)
    won: list[str] = []
    refused: list[str] = []
    leases = [loc.lease(f"racer-{i}", **kw) for i in range(n)]

    def go(lease: OutputLease) -> None:
        barrier.wait()
        try:
            lease.acquire()
            won.append(lease.job)
        except LeaseHeld as e:
            refused.append(str(e))
        except Exception as e:  # noqa: BLE001  (reported by the caller's assert)
            refused.append(f"unexpected {type(e).__name__}: {e}")

    threads = [threading.Thread(target=go, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lease in leases:
        lease.release()
    return won, refused


def test_racing_acquirers_exactly_one_wins(loc: Location) -> None:
    rounds = 20 if loc.kind == "local" else 3
    for _ in range(rounds):
        won, refused = race(loc, 4)
        assert len(won) == 1 and len(refused) == 3, (won, refused)
        assert all(f"job {won[0]} " in m for m in refused), (won, refused)
        assert loc.holder() is None


def test_racing_takers_of_a_stale_lease_exactly_one_wins(loc: Location) -> None:
    rounds = 10 if loc.kind == "local" else 2
    for _ in range(rounds):
        loc.write(foreign(age=30.0))
        # Long enough that the winner's unrenewed lease stays fresh on a loaded machine.
        won, refused = race(loc, 4, stale_after_s=10.0, renew_every_s=5.0)
        assert len(won) == 1 and len(refused) == 3, (won, refused)
        assert all(f"job {won[0]} " in m for m in refused), (won, refused)


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
