"""Every merge method of ram-dist against mergekit and against the I/O floor of its own
passes, in one run and one table (issue 43, point 6): by default all of
`ram_dist.methods.registry` and three rank-16 LoRA adapters merged with ram_plus.

Inputs: the bf16 Llama base and three agents of ``benchmarks.inputs`` (``--params`` each,
generated once in ``--workdir`` and reused), and for ``lora_r16`` three PEFT rank-16 adapters
of a base of the same size (``benchmarks.bench_lora``'s, in ``WORKDIR/lora``). Each method
merges what `benchmarks.method_table` says (slerp, nearswap, arcee_fusion: the base and one
agent; nuslerp: two; linear, karcher: the three agents, no base; passthrough: one agent),
with the parameters written there, as one mergekit-style YAML both tools read. A Ray head
is started with ``ray start --head`` (its own session and temporary folder) and stopped at
the end. Then, ``--repeats`` times, for each method of ``--methods`` in turn:

* ``floor``: read the method's inputs once with plain buffered reads, and write the base's
  bytes once, ``--floor-samples`` times in turn (the medians count: one write of the same
  bytes took 0.18 s to 2.00 s within one run); the floor of the method's passes is
  ``read_pass_s * passes + write_s``, where ``passes`` is what the ram-dist run of the same
  repeat read over what one pass reads;
* ``running``: ``ram-dist merge CONFIG --address HEAD`` on the running Ray, as a subprocess
  (wall time and peak RSS from wait4, the passes' time from ``merge_report.json``);
* ``ramdist``: the same with ram-dist's embedded Ray (started and stopped by the command;
  left out with ``--no-embedded``, as ``running`` is with ``--no-running``);
* ``mergekit``: ``mergekit-yaml`` on the same inputs with the same parameters (``dtype:
  float32``, ``out_dtype: bfloat16``), under ``benchmarks/mergekit_wrapper.py``; ram_plus
  (and lora_r16) against mergekit's ``ram``; a method mergekit lacks is left out.

A run that fails is recorded with its error and the others go on. The JSON (``--json``) is
rewritten after every method, so an interrupted run keeps what finished. Prints one row per
method: ram-dist's passes / their floor (target: at most 2), mergekit's wall / ram-dist's
wall on the running Ray (target: at least 1.5) and the same with the embedded Ray.

Example::

    python -m benchmarks.bench_methods --params 0.5e9 --repeats 1 --workdir /tmp/ramdist-bench

from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from benchmarks import method_table as mt
from benchmarks.bench_fixed_cost import running_ray
from benchmarks.bench_lora import ensure_base, ensure_rank
from benchmarks.commands import WRAPPER, cli_command, mergekit_options
from benchmarks.inputs import ensure_models, safetensors_files
from benchmarks.running import (
    READ_BLOCK,
    check_output,
    cpu_count,
    mergekit_figures,
    ramdist_figures,
    read_files,
    run_process,
    write_bytes,
)

TOOLS = ("floor", "running", "ramdist", "mergekit")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=0.5e9, help="parameters per model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default="all", help="comma-separated, or all (the default)")
    p.add_argument("--no-mergekit", action="store_true", help="measure ram-dist and floor only")
    p.add_argument("--no-running", action="store_true", help="no running Ray, embedded only")
    p.add_argument(
        "--no-embedded", action="store_true", help="no embedded Ray, the running Ray's only"
    )
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--floor-samples", type=int, default=3, help="reads and writes of the floor, each"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--generate-only", action="store_true", help="generate the inputs and stop")
    p.add_argument(
        "--merge-arg", action="append", default=[], help="extra argument for ram-dist merge"
    )
    p.add_argument(
        "--mergekit-arg", action="append", default=[], help="extra argument for mergekit-yaml"
    )
    args = p.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.methods = list(mt.METHODS) if names == ["all"] else names
    unknown = [m for m in args.methods if m not in mt.METHODS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; valid: all, {', '.join(mt.METHODS)}")
    if args.no_running and args.no_embedded:
        p.error("--no-running and --no-embedded leave no ram-dist run to measure")
    return args


class Inputs:
    """The generated checkpoints (and adapters, if `lora_r16` is asked for) and each method's
    files, tasks and YAML."""

    def __init__(self, args: argparse.Namespace) -> None:
        shard = args.shard_mb * 10**6
        self.models = ensure_models(args.workdir, args.params, shard, args.seed)
        self.lora: Path | None = None
        if mt.LORA in args.methods:
            lora_args = SimpleNamespace(adapter_dtype="float32", seed=args.seed)
            base, layout = ensure_base(args.workdir / "lora", args.params, shard, args.seed)
            rank_dir = ensure_rank(args.workdir / "lora", base, layout, mt.LORA_RANK, lora_args,
                                   full=False)  # fmt: skip
            self.lora = rank_dir

    def base(self, method: str) -> Path:
        if method == mt.LORA:
            assert self.lora is not None
            return self.lora.parent / "models" / "base"
        return self.models.folder / "base"

    def tasks(self, method: str) -> list[Path]:
        if method == mt.LORA:
            assert self.lora is not None
            return [self.lora / f"adapter{k}" for k in range(1, 4)]
        return mt.agents(self.models.folder, method)

    def files(self, method: str) -> list[Path]:
        """The safetensors files `method` reads."""
        folders = ([self.base(method)] if mt.METHODS[method].base else []) + self.tasks(method)
        return [p for folder in folders for p in safetensors_files(folder)]

    def config(self, method: str, tool: str) -> dict[str, Any]:
        tasks: list[Any] = self.tasks(method)
        if method == mt.LORA and tool == "mergekit":
            tasks = [f"{self.base(method)}+{t}" for t in tasks]
        return mt.config(method, self.base(method).parent, tasks, tool)


def measure_floor(
    inputs: list[Path], out_bytes: int, scratch: Path, samples: int = 1
) -> dict[str, Any]:
    """Plain reads of `inputs` and writes of `out_bytes`, `samples` of each in turn, timed
    apart: their medians, and every sample."""
    buf = bytearray(READ_BLOCK)
    reads, writes, read = [], [], 0
    for _ in range(samples):
        start = time.perf_counter()
        read = read_files(inputs, buf)
        t_read = time.perf_counter()
        write_bytes(scratch, out_bytes, buf)
        end = time.perf_counter()
        scratch.unlink()
        reads.append(t_read - start)
        writes.append(end - t_read)
    return {
        "read_pass_s": statistics.median(reads),
        "write_s": statistics.median(writes),
        "read_pass_bytes": read,
        "read_samples_s": reads,
        "write_samples_s": writes,
    }


class Runner:
    """How to run each tool on a method: ram-dist's command and environments (embedded, and
    on the running Ray at `address` when given), mergekit's wrapper."""

    def __init__(self, args: argparse.Namespace, inputs: Inputs, head: Any) -> None:
        self.args, self.inputs = args, inputs
        self.cli, self.env = cli_command(None)
        self.address, self.head_env = head if head else (None, None)

    def measure(self, method: str, tool: str, repeat: int) -> dict[str, Any]:
        work = self.args.workdir
        if tool == "floor":
            out_bytes = sum(p.stat().st_size for p in safetensors_files(self.inputs.base(method)))
            scratch, samples = work / "floor_out.bin", self.args.floor_samples
            return measure_floor(self.inputs.files(method), out_bytes, scratch, samples)
        out = work / "out" / f"{tool}-{method}"
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        log = work / f"{tool}-{method}_{repeat}.log"
        config = work / f"{'mergekit' if tool == 'mergekit' else 'ramdist'}_{method}.yaml"
        kind = "mergekit" if tool == "mergekit" else "ramdist"
        config.write_text(yaml.safe_dump(self.inputs.config(method, kind), sort_keys=False))
        cache = work / "mergekit-lora-cache"
        shutil.rmtree(cache, ignore_errors=True)
        if tool == "mergekit":
            stats = work / f"mergekit-{method}_{repeat}.io.json"
            mk = [str(config), str(out), *mergekit_options(self.args)]
            if method == mt.LORA:
                mk += ["--lora-merge-cache", str(cache), "--lora-merge-dtype", "bfloat16"]
            cmd = [sys.executable, str(WRAPPER), str(stats), "--", *mk]
            wall, usage = run_process(cmd, self.env, log)
            sample = mergekit_figures(json.loads(stats.read_text()), wall, usage.ru_maxrss * 1024)
        else:
            cmd = [*self.cli, "merge", str(config), "--out", str(out), *self.args.merge_arg]
            env = self.env
            if tool == "running":
                cmd += ["--address", str(self.address)]
                env = self.head_env
            wall, usage = run_process(cmd, env, log)
            report = json.loads((out / "merge_report.json").read_text())
            sample = ramdist_figures(report, wall, usage.ru_maxrss * 1024, cpu_count())
        sample |= check_output(out, self.inputs.models.tensors)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
        return sample


def tools_for(args: argparse.Namespace, method: str) -> list[str]:
    skip = ({"running"} if args.no_running else set()) | (
        {"ramdist"} if args.no_embedded else set()
    )
    if args.no_mergekit or mt.METHODS[method].mergekit_name(method) is None:
        skip.add("mergekit")
    return [t for t in TOOLS if t not in skip]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.generate_only:
        # Generate in a child: generating raises this process's peak RSS, which every
        # process forked from it would inherit in wait4's figure.
        cmd = [sys.executable, "-m", "benchmarks.bench_methods", *argv, "--generate-only"]
        subprocess.run(cmd, check=True)
    inputs = Inputs(args)
    if args.generate_only:
        return 0
    for method in args.methods:  # into the page cache
        read_files(inputs.files(method), bytearray(READ_BLOCK))
    load = os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {}
    result: dict[str, Any] = {"params": inputs.models.dims.params, "cpus": cpu_count()}
    with contextlib.ExitStack() as stack:
        head = None if args.no_running else stack.enter_context(running_ray(dict(os.environ)))
        runner = Runner(args, inputs, head)
        for r in range(args.repeats):
            for method in args.methods:
                for tool in tools_for(args, method):
                    samples.setdefault(f"{tool}:{method}", []).append(
                        _sample(runner, method, tool, r + 1)
                    )
                result |= {"load_before": load, "load_now": os.getloadavg(), "samples": samples,
                           "summary": summarize(args, samples)}  # fmt: skip
                if args.json is not None:
                    args.json.write_text(json.dumps(result, indent=1, default=str))
    params, end = inputs.models.dims.params / 1e9, os.getloadavg()[0]
    print(f"\n{params:.3f} B params per checkpoint, {cpu_count()} CPUs, load average "
          f"{load[0]:.1f} at the start, {end:.1f} at the end")  # fmt: skip
    print_table(result.get("summary", {}))
    return 0


def _sample(runner: Runner, method: str, tool: str, repeat: int) -> dict[str, Any]:
    """One run's figures, or its error (the run goes on)."""
    try:
        sample = runner.measure(method, tool, repeat)
    except Exception as e:  # noqa: BLE001 -- recorded, and the other runs go on
        traceback.print_exc()
        print(f"repeat {repeat}: {tool}:{method} FAILED: {str(e)[:300]}", flush=True)
        return {"error": str(e)[-2000:]}
    shown = sample.get("wall_s", sample.get("read_pass_s"))
    print(f"repeat {repeat}: {tool}:{method} {shown:.2f} s", flush=True)
    return sample


def summarize(
    args: argparse.Namespace, samples: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Per method, medians over the repeats that succeeded of each figure and ratio."""
    out: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        runs = {t: samples.get(f"{t}:{method}", []) for t in TOOLS}
        rows: list[dict[str, Any]] = []
        for i, floor in enumerate(runs["floor"]):
            row = _row(
                {t: (v[i] if i < len(v) else {}) for t, v in runs.items()} | {"floor": floor}
            )
            rows.append(row)
        keys = {k for r in rows for k in r}
        out[method] = {
            k: statistics.median(v) for k in sorted(keys) if (v := [r[k] for r in rows if k in r])
        }
        out[method]["mergekit_method"] = mt.METHODS[method].mergekit_name(method)
    return out


def _row(run: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The figures of one repeat of one method, from the runs that succeeded."""
    floor, row = run["floor"], {}
    ok = {t: s for t, s in run.items() if s and "error" not in s}
    for tool in ("running", "ramdist"):
        if tool in ok and "floor" in ok and ok[tool].get("bytes_read"):
            rd = ok[tool]
            passes_read = rd["bytes_read"] / floor["read_pass_bytes"]
            floor_s = floor["read_pass_s"] * passes_read + floor["write_s"]
            row |= {f"{tool}_wall_s": rd["wall_s"], f"{tool}_passes_s": rd["passes_s"],
                    f"{tool}_passes_over_floor": rd["passes_s"] / floor_s,
                    f"{tool}_rss_bytes": rd["largest_process_rss_bytes"]}  # fmt: skip
            row |= {"passes_read": passes_read, "floor_s": floor_s}
    if "mergekit" in ok:
        row |= {"mergekit_wall_s": ok["mergekit"]["wall_s"],
                "mergekit_rss_bytes": ok["mergekit"]["largest_process_rss_bytes"]}  # fmt: skip
        for tool in ("running", "ramdist"):
            if f"{tool}_wall_s" in row:
                row[f"mergekit_over_{tool}"] = ok["mergekit"]["wall_s"] / row[f"{tool}_wall_s"]
    return row


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    """One row per method: passes / floor (running Ray's run), mergekit / ram-dist walls."""
    print("\n| method | passes / floor | mergekit wall / ram-dist wall, running Ray | "
          "same, embedded Ray | ram-dist wall: running, embedded | mergekit wall |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for method, s in summary.items():
        mk = s.get("mergekit_method")
        name = method if mk in (method, None) else f"{method} (mergekit `{mk}`)"
        none = "mergekit has none" if mk is None else "-"
        passes = s.get("running_passes_over_floor", s.get("ramdist_passes_over_floor"))
        running, embedded = s.get("mergekit_over_running"), s.get("mergekit_over_ramdist")
        print(f"| {name} | {_x(passes)} | {_x(running, none)} | {_x(embedded, none)} "
              f"| {_s(s.get('running_wall_s'))}, {_s(s.get('ramdist_wall_s'))} "
              f"| {_s(s.get('mergekit_wall_s'))} |")  # fmt: skip


def _x(value: float | None, missing: str = "-") -> str:
    return missing if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
