"""Decide what an output location means for this job: new, resumable, finished, or foreign.

Runs on the driver before any heavy work. A folder holding this job's manifest is resumed;
one holding another job's manifest is refused, naming what changed; anything else that holds
files is refused. `--overwrite` starts afresh in all three cases.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from ram_dist.errors import RamDistError
from ram_dist.io.failures import explained, is_storage_failure
from ram_dist.io.manifest import Manifest, differences, load_manifest
from ram_dist.io.names import INDEX_NAME, LEASE_NAME, MANIFEST_NAME, WRITE_CHECK_PREFIX
from ram_dist.io.sinks import OutputSink, choose_sink
from ram_dist.io.storage import join
from ram_dist.planning.job import Job


@dataclass
class OutputState:
    """The manifest to continue from, and whether the job is already finished."""

    manifest: Manifest
    resumed: bool
    finished: bool


def check_not_an_input(job: Job) -> None:
    """Writing into an input would corrupt it: the output may not be, or lie inside, one."""
    assert job.out is not None
    for ckpt in [job.base, *job.tasks]:
        if job.out == ckpt.url or job.out.startswith(ckpt.url.rstrip("/") + "/"):
            raise RamDistError(
                f"output {job.out} is or lies inside {ckpt.label} ({ckpt.url}); "
                "choose an output location outside every input"
            )


def check_writable(job: Job) -> None:
    """Fail before any heavy work when the output cannot be written."""
    assert job.out is not None
    if job.storage.is_local(job.out):
        path = os.path.abspath(job.out)
        while not os.path.exists(path):
            path = os.path.dirname(path)
        if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
            raise RamDistError(
                f"output {job.out} cannot be written: {path} is not a writable folder"
            )
        return
    probe = join(job.out, f"{WRITE_CHECK_PREFIX}-{uuid.uuid4().hex[:12]}")
    fs, path = job.storage.fs(probe)
    try:
        fs.pipe_file(path, b"")
        fs.rm(path)
    except Exception as e:  # noqa: BLE001  (any failure means: cannot write there)
        if is_storage_failure(e):
            raise explained(f"output {job.out} cannot be written", e, job.out, "write") from e
        raise RamDistError(f"output {job.out} cannot be written ({type(e).__name__}: {e})") from e


def open_output(job: Job) -> OutputState:
    """Check the output location against the job; never writes."""
    assert job.out is not None
    check_not_an_input(job)
    fs, path = job.storage.fs(job.out)
    fresh = Manifest(
        identity=job.identity(),
        shard_names=list(job.layout.shards),
        sharded=job.layout.sharded,
    )
    if not fs.exists(path):
        return OutputState(fresh, resumed=False, finished=False)
    if not fs.isdir(path):
        raise RamDistError(f"output {job.out} exists and is not a folder")
    held = [n for n in fs.ls(path, detail=False) if not _is_transient(n)]
    if job.config.overwrite or not held:
        return OutputState(fresh, resumed=False, finished=False)
    old = load_manifest(job.out, job.storage)
    if old is None:
        raise RamDistError(
            f"output {job.out} already holds files and no {MANIFEST_NAME}; choose an empty "
            "location or pass --overwrite"
        )
    changes = differences(old.identity, fresh.identity)
    if changes:
        raise RamDistError(
            f"output {job.out} holds a merge of other inputs or parameters; changed: "
            + "; ".join(changes)
            + ". Use another output location, or pass --overwrite to replace it"
        )
    finished = old.complete and (
        fs.exists(join(path, INDEX_NAME))
        if old.sharded
        else set(old.shards) >= set(old.shard_names)
    )
    return OutputState(old, resumed=True, finished=finished)


def _is_transient(path: str) -> bool:
    """The output's lease (and its short-lived helper files) or a run's write check, which
    are no output files: a run starting beside another must not take them for a model."""
    return path.rstrip("/").rsplit("/", 1)[-1].startswith((LEASE_NAME, WRITE_CHECK_PREFIX))


def output_sink_for(job: Job, nodes: int | None) -> OutputSink:
    """The sink the map pass writes the output through on a cluster of `nodes` nodes (None:
    not known, as in `ram-dist plan`)."""
    assert job.out is not None
    single_node = None if nodes is None else nodes == 1
    return choose_sink(
        job.out, job.storage, shared=job.config.output_shared, single_node=single_node
    )


def clear_published(job: Job) -> None:
    """Before overwriting: remove the index and manifest, so nothing looks finished."""
    assert job.out is not None
    fs, path = job.storage.fs(job.out)
    for name in (INDEX_NAME, MANIFEST_NAME):
        if fs.exists(join(path, name)):
            fs.rm(join(path, name))
