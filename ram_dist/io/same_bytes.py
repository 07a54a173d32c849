"""Whether tensors hold the same bytes in every input: read on the driver, before any work.

Integer and bool tensors are copied from the base, not merged (`docs/exactness.md`); a
task whose bytes differ there would lose its change without a word, so the job asks first.
They are few and small in the checkpoints ram-dist merges (none, or a buffer or two), and
they are compared in batches of bounded size whatever their number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ram_dist.io.storage import Storage

#: Bytes read at once, over every input: bounds the driver's memory for the comparison.
BATCH_BYTES = 64 * 2**20

Ranges = Sequence[tuple[str, int, int]]
"""One tensor's byte range `(url, start, end)` in each input, base first, all one length."""


def differing(tensors: Mapping[str, Ranges], storage: Storage) -> dict[str, int]:
    """The tensors whose bytes in some input differ from the base's, in order, each with the
    first such input (its index among the ranges: 1 is the first after the base)."""
    found: dict[str, int] = {}
    batch: list[tuple[str, Ranges]] = []
    held = 0

    def flush() -> None:
        nonlocal held
        requests = [r for _, ranges in batch for r in ranges]
        blobs = storage.read_ranges(requests) if requests else []
        at = 0
        for name, ranges in batch:
            base, *others = blobs[at : at + len(ranges)]
            at += len(ranges)
            first = next((i for i, o in enumerate(others, 1) if bytes(o) != bytes(base)), 0)
            if first and name not in found:
                found[name] = first
        batch.clear()
        held = 0

    for name, ranges in tensors.items():
        url, start, end = ranges[0]
        step = max(1, BATCH_BYTES // len(ranges))
        for lo in range(start, end, step):
            hi = min(lo + step, end)
            piece = [(u, s + lo - start, s + hi - start) for u, s, _ in ranges]
            if held + (hi - lo) * len(ranges) > BATCH_BYTES:
                flush()
            batch.append((name, piece))
            held += (hi - lo) * len(ranges)
    flush()
    return found
