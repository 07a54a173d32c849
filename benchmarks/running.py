"""Running and timing what `bench_merge` measures: the I/O floor in this process, the merges
as subprocesses (wall time and peak memory from wait4, figures from ram-dist's report or the
mergekit wrapper's record), in rotating order over the repeats."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.commands import (
    WRAPPER,
    MethodParams,
    Run,
    mergekit_config,
    mergekit_options,
    ramdist_method_args,
)
from benchmarks.inputs import Models, model_names, safetensors_files

READ_BLOCK = 16 * 1024 * 1024


def cpu_count() -> int:
    """CPUs this process may use: what a local Ray offers as workers by default."""
    return len(os.sched_getaffinity(0))


def run_process(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, Any]:
    """Run ``cmd`` with output to ``log``; return its wall time and its wait4 rusage.

    The command runs in the log's folder, not the caller's: ``python -m`` puts the working
    directory first on ``sys.path``, which would shadow a ``PYTHONPATH`` given with ``--cli``.
    """
    with open(log, "w") as log_f:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, cwd=log.parent, stdout=log_f, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"command failed (exit {code}): {' '.join(cmd)}\n{tail}")
    return wall, usage


# --------------------------------------------------------------------------------------------
# I/O floor
# --------------------------------------------------------------------------------------------


def read_files(paths: Sequence[Path], buf: bytearray) -> int:
    """Read every byte of ``paths`` with plain buffered reads; return the byte count."""
    view = memoryview(buf)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def write_bytes(path: Path, nbytes: int, buf: bytearray) -> None:
    """Write ``nbytes`` to ``path`` in blocks of ``len(buf)`` (no fsync)."""
    view = memoryview(buf)
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(view[: min(left, len(view))])


def measure_floor(inputs: Sequence[Path], out_bytes: int, scratch: Path) -> dict[str, Any]:
    """Time two full reads of the inputs plus one write of ``out_bytes``."""
    buf = bytearray(READ_BLOCK)
    start = time.perf_counter()
    read_bytes = read_files(inputs, buf) + read_files(inputs, buf)
    t_read2 = time.perf_counter()
    write_bytes(scratch, out_bytes, buf)
    end = time.perf_counter()
    scratch.unlink()
    return {
        "wall_s": end - start,
        "floor_read_pass_s": (t_read2 - start) / 2,
        "floor_write_s": end - t_read2,
        "bytes_read": read_bytes,
        "out_bytes": out_bytes,
    }


def warm_page_cache(models: Models) -> None:
    """Read every input once, so that every configuration reads from the page cache."""
    read_files(models.inputs(), bytearray(READ_BLOCK))


# --------------------------------------------------------------------------------------------
# Figures of one run
# --------------------------------------------------------------------------------------------


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


def check_output(out: Path, expected_tensors: int) -> dict[str, int]:
    """Bytes and tensor count of a merge output; raise unless it holds every tensor."""
    files = safetensors_files(out)
    tensors = sum(len([k for k in safetensors_header(p) if k != "__metadata__"]) for p in files)
    if tensors != expected_tensors:
        raise RuntimeError(f"{out}: {tensors} tensors written, expected {expected_tensors}")
    return {"out_bytes": sum(p.stat().st_size for p in files), "out_tensors": tensors}


def dig(data: Any, dotted: str) -> Any:
    """``data["a"]["b"]`` for ``"a.b"``; None when any key is missing."""
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


REPORT_KEYS = {
    "reduce_s": "passes.reduce.wall_s",
    "map_s": "passes.map.wall_s",
    "reduce_bytes_read": "passes.reduce.bytes_read",
    "map_bytes_read": "passes.map.bytes_read",
    "map_bytes_written": "passes.map.bytes_written",
    "units": "passes.map.units",
    "driver_peak_rss_bytes": "memory.driver_peak_rss_bytes",
    "worker_peak_rss_bytes": "memory.worker_peak_rss_bytes",
    "driver_peak_private_bytes": "memory.driver_peak_private_bytes",
    "worker_peak_private_bytes": "memory.worker_peak_private_bytes",
}


def total(*values: Any) -> float | None:
    """Sum of the values, or None when any is missing."""
    return None if None in values else sum(values)


def ramdist_figures(report: dict[str, Any], wall: float, maxrss: int, workers: int) -> dict:
    """One ram-dist run as named figures (None where the report lacks a key)."""
    sample: dict[str, Any] = {"wall_s": wall, "proc_maxrss_bytes": maxrss}
    for name, dotted in REPORT_KEYS.items():
        value = dig(report, dotted)
        sample[name] = value if isinstance(value, (int, float)) else None
    sample["bytes_read"] = total(sample["reduce_bytes_read"], sample["map_bytes_read"])
    sample["passes_s"] = total(sample["reduce_s"], sample["map_s"])
    sample["overhead_s"] = None if sample["passes_s"] is None else wall - sample["passes_s"]
    # The first reduce task's wait: the workers' start, inside the passes' time.
    rows = dig(report, "passes.reduce.timeline.workers") or []
    sample["reduce_first_task_s"] = min((r["before_first_s"] for r in rows), default=None)
    units = sample["units"]
    sample["workers_used"] = None if units is None else min(units, workers)
    peaks = [sample["driver_peak_rss_bytes"], sample["worker_peak_rss_bytes"], maxrss]
    sample["largest_process_rss_bytes"] = max(v for v in peaks if v is not None)
    return sample


def mergekit_figures(stats: dict[str, Any], wall: float, maxrss: int) -> dict[str, Any]:
    """One mergekit run as named figures, from wait4 and the wrapper's I/O record."""
    io, before = stats["proc_io"], stats.get("proc_io_before") or {}
    children = sum(c.get("rchar", 0) for c in stats.get("children_io", {}).values())
    return {
        "wall_s": wall,
        "proc_maxrss_bytes": maxrss,
        "largest_process_rss_bytes": maxrss,
        "bytes_read": stats["tensor_bytes_loaded"],
        "rchar_bytes": io["rchar"] + children,
        "rchar_merge_bytes": io["rchar"] - before.get("rchar", 0) + children,
        "live_children": len(stats.get("children_io", {})),
    }


# --------------------------------------------------------------------------------------------
# Running the configurations
# --------------------------------------------------------------------------------------------


@dataclass
class Bench:
    """One set of generated inputs and how to run every configuration on them."""

    args: argparse.Namespace
    workdir: Path
    models: Models
    params: MethodParams
    ramdist_cli: list[str]
    env: dict[str, str]

    @property
    def models_dir(self) -> Path:
        return self.models.folder

    @property
    def inputs(self) -> list[Path]:
        return self.models.inputs()

    @property
    def base_bytes(self) -> int:
        return sum(p.stat().st_size for p in safetensors_files(self.models_dir / "base"))

    @property
    def input_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.inputs)

    def out_dir(self, run: Run) -> Path:
        return self.workdir / "out" / run.slug

    def yaml_path(self, run: Run) -> Path:
        return self.workdir / f"mergekit_{run.method}.yaml"

    def command(self, run: Run, repeat: int = 1) -> list[str]:
        """The exact command line of ``run`` (the floor has none)."""
        out = self.out_dir(run)
        if run.tool in ("ramdist", "previous"):
            argv = ["merge", "--base", str(self.models_dir / "base")]
            for name in model_names()[1:]:
                argv += ["--task", str(self.models_dir / name)]
            argv += ["--out", str(out), "--method", run.method]
            if self.args.unit_mb is not None:
                argv += ["--unit-mb", str(self.args.unit_mb)]
            if self.args.workers is not None:
                argv += ["--workers", str(self.args.workers)]
            argv += ramdist_method_args(run.method, self.params) + list(self.args.merge_arg)
            if run.tool == "previous":
                if not self.args.previous_cli:
                    raise SystemExit("--runs previous:... needs --previous-cli")
                return shlex.split(self.args.previous_cli) + argv
            return self.ramdist_cli + argv
        if run.tool == "mergekit":
            stats = self.workdir / f"{run.slug}_{repeat}.io.json"
            mk = [str(self.yaml_path(run)), str(out)] + mergekit_options(self.args)
            return [sys.executable, str(WRAPPER), str(stats), "--"] + mk
        return []

    def user_command(self, run: Run) -> str:
        """What a user would type for ``run`` (mergekit without the measuring wrapper)."""
        cmd = self.command(run)
        if run.tool == "mergekit":
            cmd = ["mergekit-yaml"] + cmd[cmd.index("--") + 1 :]
        return " ".join(shlex.quote(c) for c in cmd) if cmd else "(in-process reads and writes)"

    def write_mergekit_configs(self, runs: Sequence[Run]) -> None:
        for run in runs:
            if run.tool == "mergekit":
                config = mergekit_config(run.method, self.params, self.models_dir)
                self.yaml_path(run).write_text(yaml.safe_dump(config, sort_keys=False))

    def measure(self, run: Run, repeat: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run ``run`` once; return its figures and (ram-dist) its merge report."""
        if run.tool == "floor":
            return measure_floor(self.inputs, self.base_bytes, self.workdir / "floor_out.bin"), {}
        out = self.out_dir(run)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(run, repeat)
        wall, usage = run_process(cmd, self.env, self.workdir / f"{run.slug}_{repeat}.log")
        maxrss = usage.ru_maxrss * 1024  # Linux reports KiB
        report: dict[str, Any] = {}
        if run.tool in ("ramdist", "previous"):
            report_path = out / "merge_report.json"
            report = json.loads(report_path.read_text()) if report_path.is_file() else {}
            workers = self.args.workers or cpu_count()
            sample = ramdist_figures(report, wall, maxrss, workers)
        else:
            stats = json.loads(Path(cmd[2]).read_text())
            sample = mergekit_figures(stats, wall, maxrss)
        sample |= check_output(out, self.models.tensors)
        if not self.args.keep:
            shutil.rmtree(out, ignore_errors=True)
        return sample, report


def rotated(runs: Sequence[Run], k: int) -> list[Run]:
    """``runs`` started at position ``k``: each repeat starts with the next configuration."""
    k %= max(1, len(runs))
    return list(runs[k:]) + list(runs[:k])


def measure_all(
    bench: Bench, runs: Sequence[Run], repeats: int
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """``repeats`` rounds over ``runs`` in rotating order; samples (the k-th of each run from
    the same round) and the last report per run."""
    samples: dict[str, list[dict[str, Any]]] = {run.name: [] for run in runs}
    reports: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        for run in rotated(runs, r):
            sample, report = bench.measure(run, r + 1)
            samples[run.name].append(sample)
            if report:
                reports[run.name] = report
            print(f"repeat {r + 1}/{repeats}: {run.name} {sample['wall_s']:.2f} s", flush=True)
    return samples, reports
