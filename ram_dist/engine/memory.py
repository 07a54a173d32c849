"""Peak memory of a process, with and without the pages of Ray's shared object store.

`ru_maxrss` counts every resident page, including the object store's shared memory that Ray
maps into each process that writes or reads an object: a worker that has returned many units
and a driver that has received them show the store's pages, which grow with the number of
units, not with what the process itself holds. The private figure (anonymous and file-backed
resident pages, `RssAnon + RssFile` on Linux) leaves those out; `note()` samples it where a
unit's memory peaks (every block, and with the merged bytes about to be returned).
"""

from __future__ import annotations

import resource

_peak_private = 0


def peak_rss() -> int:
    """This process's peak resident memory so far, shared pages included: `VmHWM` on Linux.
    Not `ru_maxrss`, which Linux carries over from before `exec`: a process started by a
    large parent (a benchmark that generated the models) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def private_bytes() -> int:
    """Resident memory of this process now, without shared-memory pages; on systems without
    `/proc/self/status`, the peak resident memory instead."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))
    except (OSError, KeyError, ValueError):
        return peak_rss()


def note() -> int:
    """Sample `private_bytes` and return the largest sample so far in this process."""
    global _peak_private
    _peak_private = max(_peak_private, private_bytes())
    return _peak_private
