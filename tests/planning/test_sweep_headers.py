"""A sweep reads its inputs' headers once, whatever its variants: every variant is planned
from the same headers (`planning.sweep.prepare_sweep`), and the checks before any work read
the inputs once for all (`engine.sweep.sweep_checks`). Counted by a local filesystem that
counts the reads at the start of each safetensors file (where its header is), registered
for plain paths while the test runs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from builders import build_model_set
from fsspec.implementations.local import LocalFileSystem

from ram_dist.engine.sweep import SweepClaim, sweep_checks
from ram_dist.planning.config import MergeConfig
from ram_dist.planning.job import prepare

#: Twelve variants over five methods: RAM+'s r and alpha, TIES's and DELLA's densities.
METHODS = ("ram_plus", "ties", "della", "task_arithmetic", "model_stock")
GRID = {"r": [0.05, 0.1, 0.2], "alpha": [1.0, 2.0], "density": [0.3, 0.5]}


class CountingFileSystem(LocalFileSystem):
    """Local files, counting per safetensors file the reads that start at its first byte."""

    header_reads: ClassVar[Counter[str]] = Counter()

    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kw: Any):
        name = self._strip_protocol(path)
        if name.endswith(".safetensors") and not start:
            CountingFileSystem.header_reads[name] += 1
        return super().cat_file(path, start, end, **kw)


@pytest.fixture
def counting() -> Iterator[Counter[str]]:
    fsspec.register_implementation("file", CountingFileSystem, clobber=True)
    CountingFileSystem.header_reads.clear()
    try:
        yield CountingFileSystem.header_reads
    finally:
        fsspec.register_implementation("file", LocalFileSystem, clobber=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sweep_headers")
    base, tasks, _, _ = build_model_set(root, base_shard="100KB")
    files = sorted(str(p) for d in [base, *tasks] for p in Path(d).glob("*.safetensors"))
    return {"base": base, "tasks": tasks, "root": root, "files": files}


def _config(models: dict, out: Path, **kw: Any) -> MergeConfig:
    return MergeConfig(
        base=str(models["base"]), tasks=tuple(map(str, models["tasks"])), out=str(out), **kw
    )


def test_a_sweep_of_twelve_variants_reads_each_header_once(models, tmp_path, counting):
    config = _config(models, tmp_path / "sweep", methods=METHODS, grid=GRID)
    with contextlib.ExitStack() as held:
        claim = sweep_checks(config, held)
        assert isinstance(claim, SweepClaim)
        assert len(claim.sweep.jobs) == 12
    assert len(models["files"]) > 4  # a sharded base: several files an input
    assert dict(counting) == dict.fromkeys(models["files"], 1)
    # every variant planned from the same inputs as read
    first = claim.sweep.jobs[0]
    assert all(j.base is first.base and j.tasks is first.tasks for j in claim.sweep.jobs)


def test_the_variants_plans_are_their_single_merges(models, tmp_path, counting):
    """Planned from shared headers, each variant's job is the one its single merge plans:
    the same identity, layout, parameters and units."""
    config = _config(models, tmp_path / "sweep", methods=METHODS, grid=GRID, unit_budget_bytes=4096)
    with contextlib.ExitStack() as held:
        claim = sweep_checks(config, held)
    assert isinstance(claim, SweepClaim)
    for variant, job in zip(claim.sweep.variants, claim.sweep.jobs, strict=True):
        single = prepare(variant.config)
        assert job.identity() == single.identity(), variant.name
        assert job.layout == single.layout and job.units == single.units, variant.name
        assert job.params == single.params, variant.name
