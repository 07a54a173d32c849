"""Connect to a Ray cluster, or start an embedded one when there is none. Driver side."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class Cluster:
    """What the driver needs to know of the cluster it runs on."""

    cpus: int
    gpus: int
    embedded: bool
    memory: int = 0
    """Bytes of Ray's `memory` resource over all nodes (what tasks may use)."""


@contextmanager
def ray_cluster(address: str | None) -> Iterator[Cluster]:
    """Use the Ray already initialised in this process, else `address` / `RAY_ADDRESS`, else
    start a local Ray for the duration of the job (and stop it afterwards)."""
    started = False
    if not ray.is_initialized():
        # "local" always starts a new instance, never a `ray start` cluster found on disk.
        address = address or os.environ.get("RAY_ADDRESS") or None
        ray.init(
            address=address or "local",
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
        started = True
    try:
        res = ray.cluster_resources()
        yield Cluster(
            cpus=max(1, int(res.get("CPU", 1))),
            gpus=int(res.get("GPU", 0)),
            embedded=started and not address,
            memory=int(res.get("memory", 0)),
        )
    finally:
        if started:
            ray.shutdown()
