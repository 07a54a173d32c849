"""Peak memory of a process, with and without the pages of Ray's shared object store.

`ru_maxrss` counts every resident page, including the object store's shared memory that Ray
maps into each process that writes or reads an object: a worker that has returned many units
and a driver that has received them show the store's pages, which grow with the number of
units, not with what the process itself holds. The private figure is psutil's USS (pages
mapped by this process alone), which leaves those out, and shared libraries too. A
`PeakMemory` samples it where memory peaks (every block, and with the merged bytes about to
be returned), at most every `every_s` seconds: a sample reads `/proc/self/smaps_rollup`.
"""

from __future__ import annotations

import resource
import time

import psutil


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
    """Memory of this process now that no other process maps (USS); where the system does
    not tell it, the resident memory instead."""
    process = psutil.Process()
    try:
        return int(process.memory_full_info().uss)
    except (psutil.Error, AttributeError):
        return int(process.memory_info().rss)


class PeakMemory:
    """The largest `private_bytes` sampled while something runs (a task, the driver's job)."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.peak = 0
        self._every_s = every_s
        self._last = float("-inf")

    def note(self, now: bool = False) -> int:
        """Sample (when `now`, or `every_s` has passed since the last sample); the peak."""
        t = time.monotonic()
        if now or t - self._last >= self._every_s:
            self._last = t
            self.peak = max(self.peak, private_bytes())
        return self.peak


#: The driver's own peak (the process that runs the job and receives the results).
DRIVER = PeakMemory()
