"""Peak memory of a process, with and without the pages of Ray's shared object store.

`ru_maxrss` counts every resident page, including the object store's shared memory that Ray
maps into each process that writes or reads an object: a worker that has returned many units
and a driver that has received them show the store's pages, which grow with the number of
units, not with what the process itself holds. The private figure is psutil's USS (pages
mapped by this process alone), which leaves those out, and shared libraries too. A
`PeakMemory` samples it where memory peaks (every block, and with the merged bytes about to
be returned), rate-limited so that sampling costs little: a sample reads
`/proc/self/smaps_rollup`.
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
    """The largest `private_bytes` sampled while something runs (a worker process, the
    driver's job).

    A sample is not free: reading `smaps_rollup` of a Ray process takes about 10 ms here, as
    long as a small unit's whole work. So samples are at least `every_s` apart and at least
    `1 / max_share` times their own cost apart: sampling takes at most that share of the time.
    """

    def __init__(self, every_s: float = 0.05, max_share: float = 0.02) -> None:
        self.peak = 0
        self._every_s = every_s
        self._max_share = max_share
        self._gap = every_s
        self._last = float("-inf")

    def note(self, now: bool = False) -> int:
        """Sample (when `now`, or the gap has passed since the last sample); the peak."""
        t = time.monotonic()
        if now or t - self._last >= self._gap:
            self.peak = max(self.peak, private_bytes())
            self._last = time.monotonic()
            self._gap = max(self._every_s, (self._last - t) / self._max_share)
        return self.peak
