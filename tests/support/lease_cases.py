"""The output lease's tests that every store runs (`test_lease`: local, S3, GCS;
`test_lease_azure`: Azure Blob), each on a fresh `loc` that the importing test module's
fixture gives; and the `Location` they take, with raw access to the lease as another party
would have it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from ram_dist.errors import RamDistError
from ram_dist.io import lease as lease_mod
from ram_dist.io.lease import LEASE_NAME, Holder, LeaseHeld, OutputLease
from ram_dist.io.storage import Storage, join

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
