"""Skip a test that counts what the input cache kept when this machine's disk is already
within the cache's reserve: there the cache rightly keeps nothing (`range_cache`'s rule,
`room_above_reserve`), so such a test would fail for the disk, not for the code."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from ram_dist.io.range_cache import room_above_reserve

#: What these tests keep at most (their models are a few hundred KB), with room to spare.
KEPT_BY_A_TEST = 64 * 2**20


def cache_room() -> pytest.MarkDecorator:
    """`skipif` the disk of the temp dir (where the tests' caches live) leaves the cache less
    than `KEPT_BY_A_TEST` above its reserve, with the figures in the reason."""
    folder = tempfile.gettempdir()
    room = room_above_reserve(folder)
    free = shutil.disk_usage(folder).free
    return pytest.mark.skipif(
        room < KEPT_BY_A_TEST,
        reason=f"the disk of {folder} has {free / 1e9:.1f} GB free, within the input cache's "
        f"reserve of {(free - room) / 1e9:.1f} GB (ram_dist.io.range_cache.RESERVE_FRACTION of "
        "the disk), where the cache keeps nothing: free some space to run this test",
    )
