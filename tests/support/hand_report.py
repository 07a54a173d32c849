"""A hand-written probe-shaped RAM+ report whose numbers are worked out by hand, and a PNG's
size read from its header: shared by the tests of `ram_dist.report`."""

from __future__ import annotations

import struct

# Three tasks over 1000 participating elements. Elements changed by exactly k tasks:
# k=1: 10 + 250 + 100 = 360; k=2: (20 + 240 + 110) / 2 = 185; k=3: 10; k=0: 1000 - 555 = 445.
HAND_HIST = [[10, 20, 10], [250, 240, 10], [100, 110, 10]]


def hand_report() -> dict:
    """A probe-shaped RAM+ report (r=0.1, alpha=2) whose numbers are worked out by hand."""
    rhos = [3.0, 1.0, 1.2]  # shared / unique: 30/10, 250/250, 120/100
    tasks = []
    for i, (hist, rho) in enumerate(zip(HAND_HIST, rhos, strict=True)):
        changed = sum(hist)
        tasks.append(
            {
                "changed": changed,
                "density": changed / 1000,
                "unique": hist[0],
                "shared": changed - hist[0],
                "rho": rho,
                "histogram": hist,
                "lambda": {
                    "ram": 1.0,
                    "ram_plus": 1 + 0.1 * min(rho, 2.0),
                    "ram_plus_soft": 1 + 0.1 * rho / (1 + rho),
                },
                "model": f"/data/agents/agent{i + 1}",
            }
        )
    return {
        "ram_dist_version": "0.1.0",
        "method": "ram_plus",
        "parameters": {"r": 0.1, "alpha": 2.0, "epsilon": 1e-05, "scope": "model"},
        "base": "/data/base",
        "tasks_given": [t["model"] for t in tasks],
        "notes": [],
        "out_dtype": None,
        "unit_budget_bytes": 268435456,
        "elements": {"participating": 1000, "unchanged": 445, "by_count": [445, 360, 185, 10]},
        "tasks": tasks,
        "layers": [
            {
                "layer": "model.layers.0",
                "tasks": [
                    {"changed": 20, "unique": 5, "shared": 15, "participating": 400},
                    {"changed": 200, "unique": 100, "shared": 100, "participating": 400},
                    {"changed": 0, "unique": 0, "shared": 0, "participating": 400},
                ],
            },
            {
                "layer": "model.layers.1",
                "tasks": [
                    {"changed": 10, "unique": 5, "shared": 5, "participating": 400},
                    {"changed": 200, "unique": 100, "shared": 100, "participating": 400},
                    {"changed": 100, "unique": 25, "shared": 75, "participating": 400},
                ],
            },
            {
                "layer": "other",
                "tasks": [
                    {"changed": 10, "unique": 0, "shared": 10, "participating": 200},
                    {"changed": 100, "unique": 50, "shared": 50, "participating": 200},
                    {"changed": 120, "unique": 75, "shared": 45, "participating": 200},
                ],
            },
        ],
        "lambda_applied": [1.2, 1.1, 1.12],
        "passes": {
            "reduce": {
                "units": 2,
                "wall_s": 0.5,
                "bytes_read": 4096,
                "bytes_written": 0,
                "max_unit_bytes_read_per_input": [1024, 1024, 1024, 1024],
            }
        },
        "memory": {"driver_peak_rss_bytes": 1, "worker_peak_rss_bytes": 1},
    }


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; fails on anything else."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    return struct.unpack(">II", data[16:24])
