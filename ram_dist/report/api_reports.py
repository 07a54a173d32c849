"""What the API's calls return (`ram_dist.api`): a report as ram-dist writes it, with its
common fields as attributes. Light to import: neither torch nor Ray."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ram_dist.planning.config import MergeConfig


@dataclass(frozen=True)
class Report:
    """A report as ram-dist writes it (`data`), its common fields as attributes."""

    data: Mapping[str, Any] = field(repr=False)
    """The whole report: for a merge, what `merge_report.json` holds."""

    def as_dict(self) -> dict[str, Any]:
        """A copy of the whole report."""
        return copy.deepcopy(dict(self.data))

    def to_json(self) -> str:
        """The report as ram-dist writes it: valid JSON (an infinite rho is "inf")."""
        from ram_dist.io.writer import json_text

        return json_text(self.data)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


@dataclass(frozen=True)
class MergeReport(Report):
    """What `merge` did. For an output that already held this merge (`already_complete`),
    the report its first run wrote, as stored."""

    config: MergeConfig = field(repr=False)
    """The job as it ran: the mergekit config's settings and the arguments, resolved."""
    out: str
    """Where the model is: a URL, or an absolute local path."""
    method: str
    already_complete: bool
    shards_written: tuple[str, ...]
    shards_reused: tuple[str, ...]
    """Shards a resumed run found finished and kept."""
    bytes_written: int
    """Bytes of merged shards the map pass wrote."""
    pass_seconds: Mapping[str, float]
    """Wall time of each pass (`reduce`, `map`); a reduce pass skipped on resume took 0."""
    lambdas: tuple[float, ...] | None
    """The RAM family's lambda per task; None for the baselines and per-tensor lambdas."""

    @classmethod
    def of(cls, data: Mapping[str, Any], config: MergeConfig) -> MergeReport:
        from ram_dist.io.locations import resolve_output

        assert config.out is not None  # run_merge refused a job without one
        output = data.get("output") or {}
        passes = data.get("passes") or {}
        return cls(
            data=data,
            config=config,
            out=output.get("url") or resolve_output(config.out),
            method=data.get("method", config.method),
            already_complete=bool(data.get("already_complete")),
            shards_written=tuple(output.get("shards_written", ())),
            shards_reused=tuple(output.get("shards_reused", ())),
            bytes_written=int(passes.get("map", {}).get("bytes_written", 0)),
            pass_seconds={name: p["wall_s"] for name, p in passes.items()},
            lambdas=_lambdas(data),
        )


@dataclass(frozen=True)
class ProbeReport(Report):
    """RAM's statistics of the tasks (`probe`): per task, what it changed and how much of it
    other tasks changed too, and lambda under each RAM variant."""

    config: MergeConfig = field(repr=False)
    method: str
    """The RAM variant whose lambdas `lambdas` are (ram_plus when a baseline was asked for)."""
    tasks: tuple[Mapping[str, Any], ...]
    """Per task: model, changed, density, unique, shared, rho, lambda (per variant),
    histogram (`histogram[k - 1]`: elements it changed that k tasks changed)."""
    densities: tuple[float, ...]
    lambdas: tuple[float, ...] | None
    seconds: float
    """Wall time of the reduce pass."""
    files: tuple[str, ...]
    """What `json_path` wrote: the JSON, the figures and the per-layer table; else empty."""

    @classmethod
    def of(cls, data: Mapping[str, Any], config: MergeConfig, files: Sequence[str]) -> ProbeReport:
        tasks = tuple(data.get("tasks", ()))
        return cls(
            data=data,
            config=config,
            method=data["method"],
            tasks=tasks,
            densities=tuple(t["density"] for t in tasks),
            lambdas=_lambdas(data),
            seconds=data["passes"]["reduce"]["wall_s"],
            files=tuple(files),
        )


@dataclass(frozen=True)
class PlanReport(Report):
    """What a merge would read, run and write (`plan`); nothing was written."""

    config: MergeConfig = field(repr=False)
    method: str
    work_units: int
    unit_budget_bytes: int
    """Bytes one work unit may read from each input."""
    device: str | None
    """`cpu` or `cuda`; None where the cluster is not known before a merge connects."""
    output_state: str | None
    """`new`, `resume` (an unfinished run of this job) or `complete`; None without `out`."""
    output_path: str | None
    """`direct` (workers write their parts) or `through-driver`; None without `out`."""
    bytes_per_pass: Mapping[str, Any]
    memory_per_worker_bytes: int

    @classmethod
    def of(cls, data: Mapping[str, Any], config: MergeConfig) -> PlanReport:
        output = data.get("output") or {}
        return cls(
            data=data,
            config=config,
            method=data["method"],
            work_units=data["work_units"],
            unit_budget_bytes=data["unit_budget_bytes"],
            device=(data.get("device") or {}).get("device"),
            output_state=output.get("state"),
            output_path=output.get("path"),
            bytes_per_pass=data["bytes_per_pass"],
            memory_per_worker_bytes=data["memory_per_worker_bytes"],
        )


@dataclass(frozen=True)
class VerifyResult:
    """What `verify` found: no problems means every shard hashes as the manifest records and
    the index names exactly the recorded shards."""

    out: str
    problems: tuple[str, ...]
    """Each names the shard (and part) or file that is missing, unrecorded or differs."""
    shards_checked: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "ok": self.ok,
            "problems": list(self.problems),
            "shards_checked": self.shards_checked,
        }

    def to_json(self) -> str:
        from ram_dist.io.writer import json_text

        return json_text(self.as_dict())


def _lambdas(data: Mapping[str, Any]) -> tuple[float, ...] | None:
    applied = data.get("lambda_applied")
    return None if applied is None else tuple(applied)
