"""Whether a job keeps pass-1 input ranges on each node's disk (`InputCache`), and what the
report says of it. Driver side."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from ram_dist.io.range_cache import InputCache, job_key
from ram_dist.io.storage import join
from ram_dist.planning.job import Job


def choose_input_cache(job: Job) -> tuple[InputCache | None, str]:
    """The cache a merge keeps pass-1 input ranges in, or None; and why, in words."""
    mode = job.config.input_cache
    if mode == "off":
        return None, "off (--input-cache off)"
    if job.reduce_rounds == 0:
        return None, "off: this merge reads its inputs once"
    if mode == "auto" and all(job.storage.is_local(f) for c in _inputs(job) for f in _files(c)):
        return None, "off: every input is on a local filesystem (--input-cache on caches those too)"
    identity = json.dumps({"inputs": job.identity()["inputs"], "out": job.out}, sort_keys=True)
    cache = InputCache(job_key(identity), local_inputs=mode == "on", base_dir=job.config.cache_dir)
    scope = "every input" if mode == "on" else "inputs not on a local filesystem"
    return cache, f"on (--input-cache {mode}): {scope}, while each node's disk has room"


def _inputs(job: Job) -> list[Any]:
    return [job.base, *job.tasks]


def _files(ckpt: Any) -> list[str]:
    return [join(ckpt.url, f) for f in ckpt.files]


def cache_report(job: Job, cache: InputCache | None, note: str) -> dict[str, Any]:
    """What the cache would keep (at most: the participating ranges of the inputs it covers)
    and where; free space is this machine's, a hint for the workers' own disks."""
    out: dict[str, Any] = {"mode": job.config.input_cache, "used": cache is not None, "note": note}
    if cache is None:
        return out
    covered = {f for c in _inputs(job) for f in _files(c) if cache.covers(f, job.storage.is_local)}
    kept = round(
        sum(
            entry.numel * src.itemsize
            for entry in job.layout.tensors.values()
            if entry.participating
            for src in entry.sources
            if src.file in covered
        )
    )
    out.update({"folder": cache.root(), "bytes_kept_at_most": kept})
    out["free_bytes_here"] = _free_bytes(cache.parent())
    return out


def _free_bytes(folder: str) -> int | None:
    """Free space on the disk that holds (or would hold) `folder`."""
    while True:
        try:
            return shutil.disk_usage(folder).free
        except FileNotFoundError:
            if os.path.dirname(folder) == folder:
                return None
            folder = os.path.dirname(folder)
        except OSError:
            return None
