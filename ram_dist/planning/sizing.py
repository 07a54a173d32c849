"""Default work-unit size from the machine or cluster: its cores and memory.

A worker streams its unit through two read buffers of one compute block per input (about
`COMPUTE_BLOCK` elements each, whatever the unit size), so the unit size bounds only the
merged bytes a worker holds (in its output buffer until it writes them to the output; where
the output takes no parts from workers, in Ray's object store until the driver writes them)
and sets how finely the work is spread: units much larger than a model's share per core
leave cores idle at the end of each pass.
"""

from __future__ import annotations

import math
import os

from ram_dist.settings import MAX_UNIT_BUDGET, MEMORY_SHARE, MIN_UNIT_BUDGET, UNITS_PER_SLOT

MIB = 2**20
#: Elements a worker computes at once (a compute block); bounds its read buffers and float
#: temporaries (about 40 bytes each), whatever the unit size.
COMPUTE_BLOCK = 1 << 22


def machine() -> tuple[int, int]:
    """This machine's cores and physical memory in bytes (what an embedded Ray gets)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, cores or 1), int(memory)


def auto_unit_budget(largest_input_bytes: int, slots: int, memory_bytes: int) -> int:
    """The budget per input of one unit: at least `UNITS_PER_SLOT` units per core over the
    largest input, at most `MEMORY_SHARE` of a core's memory, within [`MIN_UNIT_BUDGET`,
    `MAX_UNIT_BUDGET`], in whole MiB (the bounds and shares are `settings`', where the
    `--unit-mb` help states them)."""
    slots = max(1, slots)
    by_units = math.ceil(largest_input_bytes / (UNITS_PER_SLOT * slots))
    by_memory = int(memory_bytes / slots * MEMORY_SHARE)
    budget = min(MAX_UNIT_BUDGET, by_units, by_memory)
    return max(MIN_UNIT_BUDGET, budget // MIB * MIB)
