"""This host's processes, from `/proc`: whether a lease's holder on this host still runs."""

from __future__ import annotations

import contextlib
import functools
import os


def machine_id() -> str:
    """This boot of this machine and this pid namespace (Linux), or "" where unknown."""
    parts = []
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts)


def process_gone(pid: int, started: float) -> bool:
    """Whether process `pid` of this host no longer exists, or is a newer process that
    reused the pid of one that held a lease since `started`."""
    if pid <= 0:
        return False  # not a process id: judge the lease by its age
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    begun = process_start(pid)
    return begun is not None and begun > started + 2.0


def process_start(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, from /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime
        return _boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")
