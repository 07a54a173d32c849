"""The fixed cost of a merge: `ram-dist merge` of the demo's tiny model, end to end, beside
Ray's own start and stop (a bare `ray.init(); ray.shutdown()` in a fresh Python) on the same
machine, in alternating rounds; what the merge costs beyond Ray's share is ours. With
`--running`, each round also merges on a Ray that is already running (a head this starts
with `ray start --head`, in a temporary folder of its own, given to the merge as
`--address`): there the whole command beyond its passes is ours and Ray's connection, and the
workers' start (the first reduce task's wait) counts in it; beside it, a bare job on the same
Ray (a fresh Python that connects, runs one empty task per CPU on the job's own new workers,
and disconnects) gives Ray's share there.

Each command runs as a subprocess, timed from outside (start to exit). The merge's own report
gives its passes and their timelines (when the worker got its first task: worker start-up
inside the passes). Prints every sample and the medians; `--json FILE` writes them.

    python -m benchmarks.bench_fixed_cost --rounds 5 [--running]

from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from ram_dist.cli.demo import make_demo_inputs

#: What a bare Ray costs: started as `ram-dist` starts its embedded one, and stopped.
BARE_RAY = (
    "import logging, ray; "
    "ray.init(address='local', include_dashboard=False, logging_level=logging.WARNING); "
    "ray.shutdown()"
)
#: What a bare job on a running Ray costs: a fresh Python connects (its address the first
#: argument), has one task per CPU run on the job's own worker processes, which Ray starts
#: for it as it does for a merge's, and disconnects.
BARE_JOB = (
    "import logging, sys, ray; "
    "ray.init(address=sys.argv[1], include_dashboard=False, logging_level=logging.WARNING); "
    "f = ray.remote(num_cpus=1)(lambda: None); "
    "ray.get([f.remote() for _ in range(int(ray.cluster_resources()['CPU']))]); "
    "ray.shutdown()"
)


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Seconds from start to exit of `argv`, run in `cwd` (not the caller's folder, where
    `python -m` would find the checkout before a `PYTHONPATH` given with `--cli`); raise if
    it fails."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return took


def merge_sample(cli: list[str], env: dict[str, str], base: str, tasks: list[str],
                 out: Path, *flags: str) -> dict[str, Any]:  # fmt: skip
    """One demo merge (with `flags`): its wall time and, from its report, its passes and
    when their first tasks started."""
    shutil.rmtree(out, ignore_errors=True)
    argv = [*cli, "merge", "--base", base, "--out", str(out), "--method", "ram_plus", *flags]
    for task in tasks:
        argv += ["--task", task]
    wall = timed(argv, env, out.parent)
    report = json.loads((out / "merge_report.json").read_text())
    passes = report["passes"]
    sample: dict[str, Any] = {"wall_s": wall}
    for name, p in passes.items():
        sample[f"{name}_s"] = p["wall_s"]
        line = p.get("timeline") or {}
        rows = line.get("workers") or []
        if rows:  # the first task of the pass: how long the workers left it waiting
            sample[f"{name}_first_task_s"] = min(r["before_first_s"] for r in rows)
    sample["passes_s"] = sum(p["wall_s"] for p in passes.values())
    # Outside the passes' own work: the whole command less the passes, the wait for the
    # workers' start (the first reduce task's) counted back in.
    sample["beyond_passes_s"] = wall - sample["passes_s"] + sample.get("reduce_first_task_s", 0)
    return sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_ray(env: dict[str, str]) -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head on this machine, started with `ray start --head` in a session and a
    temporary folder of its own (token authentication, as `ray start` sets it up), its ports
    free ones: (its address, the environment a driver connects with). Stopped by killing its
    session, never with `ray stop` (which stops every Ray here)."""
    temp = tempfile.mkdtemp(prefix="rd-fixed-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in env.items() if not k.startswith("RAY_")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    port = _free_port()
    ports = ("ray-client-server", "runtime-env-agent", "metrics-export", "node-manager",
             "object-manager", "dashboard", "dashboard-agent-listen",
             "dashboard-agent-grpc")  # fmt: skip
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
            "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
            *(f"--{name}-port={_free_port()}" for name in ports), "--num-gpus=0",
            "--disable-usage-stats", f"--temp-dir={temp}"]  # fmt: skip
    log = Path(temp) / "start.log"
    with log.open("wb") as out:
        start = subprocess.Popen(argv, env=env, cwd=temp, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    try:
        if start.wait():
            raise RuntimeError(f"ray start failed: {log.read_text()[-2000:]}")
        yield f"127.0.0.1:{port}", env
    finally:
        _kill_session(start.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _kill_session(session: int) -> None:
    """SIGKILL to every process of `session` (the head's processes keep the session of the
    `ray start` that began them, whatever their names)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == session:
                    os.kill(int(entry.name), signal.SIGKILL)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (after a warm-up)")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument(
        "--running", action="store_true", help="also merge on a running Ray (`--address`)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cli, env = cli_command(args.cli)
    work = Path(tempfile.mkdtemp(prefix="ram-dist-fixed-"))
    kinds = ("ray", "merge", "running", "job") if args.running else ("ray", "merge")
    samples: dict[str, list[Any]] = {kind: [] for kind in kinds}
    try:
        base, tasks = make_demo_inputs(str(work / "inputs"))
        with contextlib.ExitStack() as head:
            commands: dict[str, tuple[dict[str, str], list[str]]] = {"merge": (env, [])}
            if args.running:
                address, head_env = head.enter_context(running_ray(env))
                commands["running"] = (head_env, ["--address", address])
                job = [sys.executable, "-c", BARE_JOB, address]
            for round_ in range(args.rounds + 1):  # round 0 warms the caches, left out
                turn = round_ % len(kinds)  # who goes first rotates
                for kind in kinds[turn:] + kinds[:turn]:
                    if kind == "ray":
                        sample: Any = timed([sys.executable, "-c", BARE_RAY], env, work)
                    elif kind == "job":
                        sample = timed(job, head_env, work)
                    else:
                        kind_env, flags = commands[kind]
                        sample = merge_sample(cli, kind_env, base, tasks, work / "out", *flags)
                    if round_:
                        samples[kind].append(sample)
                if round_:
                    print(_round_line(round_, samples), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = _medians(samples["merge"])
    median["ray_s"] = statistics.median(samples["ray"])
    median["beyond_ray_s"] = median["wall_s"] - median["ray_s"]
    print("\nmedians: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items()))
    result = {"ray_s": samples["ray"], "merges": samples["merge"], "median": median}
    if args.running:
        on = _medians(samples["running"])
        on["bare_job_s"] = statistics.median(samples["job"])
        # Ours on the running Ray: the command less its passes' own work (the workers' start
        # is Ray's, and the bare job has it too) less the bare job.
        own_passes = on["passes_s"] - on.get("reduce_first_task_s", 0)
        on["beyond_bare_job_s"] = on["wall_s"] - own_passes - on["bare_job_s"]
        result |= {"running": samples["running"], "bare_job_s": samples["job"]}
        result["running_median"] = on
        medians = on.items()
        print("on the running Ray, medians: " + ", ".join(f"{k} {v:.2f}" for k, v in medians))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _round_line(round_: int, samples: dict[str, list[Any]]) -> str:
    merge = samples["merge"][-1]
    line = (
        f"round {round_}: ray {samples['ray'][-1]:.2f} s, merge {merge['wall_s']:.2f} s "
        f"(passes {merge['passes_s']:.2f} s)"
    )
    if "running" in samples:
        on = samples["running"][-1]
        line += (
            f", on the running Ray {on['wall_s']:.2f} s (beyond its passes, the workers' "
            f"start counted in: {on['beyond_passes_s']:.2f} s), a bare job there "
            f"{samples['job'][-1]:.2f} s"
        )
    return line


def _medians(samples: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(m[k] for m in samples if k in m) for k in samples[0]}


if __name__ == "__main__":
    raise SystemExit(main())
