"""The regime sweep: when does RAM help? Agents from the same bases and tasks as run.py, with
the RL learning rate and the number of updates varied, so that their task vectors span the
paper's range of densities; every method merged at every point, every model scored.

    python examples/rl-agents/sweep.py --out DIR                 # the whole sweep
    python examples/rl-agents/sweep.py --out DIR --point NAME    # one point (trains what it needs)
    python examples/rl-agents/sweep.py --out DIR --smoke         # a shrunken sweep, every step
    python examples/rl-agents/sweep.py --list                    # the points and their names

Every job leaves its result beside what it made, so a run that stops resumes where it was,
and `--point` runs reuse the bases and agents of earlier runs in the same DIR. Writes
DIR/sweep.json, DIR/SWEEP.md, DIR/crossover.png and DIR/regime_map.json (the table that
`ram-dist probe` places a user's agents on). See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rl_jobs import Plan, eval_job, init_worker, rl_snapshots_job, sft_job  # noqa: E402
from rl_tasks import TASK_NAMES  # noqa: E402
from run import (  # noqa: E402
    FULL,
    MAIN_MERGES,
    MAIN_SWEEP,
    SMOKE,
    SWEEP_MERGES,
    CliRunner,
    log,
    machine,
    merge_argv,
    run_sweep,
)
from sweep_report import (  # noqa: E402
    ablation_point,
    collect,
    record,
    write_into,
    write_sweep_outputs,
)


@dataclass(frozen=True)
class Point:
    """One set of agents: a learning rate and each task's number of updates."""

    name: str
    lr: float
    steps: tuple[tuple[str, int], ...]

    def updates(self, task: str) -> int:
        return dict(self.steps)[task]


@dataclass(frozen=True)
class Sweep:
    """Everything the sweep does; the bases, the RL batch and the evaluation are run.py's."""

    plan: Plan
    lrs: tuple[tuple[float, int], ...]
    """(learning rate, most updates) pairs; each gives the points of `points_at`."""
    methods: tuple[tuple[str, tuple[str, ...]], ...]
    ablations: tuple[tuple[str, tuple[str, ...]], ...]
    smoke: bool = False

    @property
    def points(self) -> list[Point]:
        return [p for lr, most in self.lrs for p in points_at(lr, most)]


def points_at(lr: float, most: int) -> list[Point]:
    """At one learning rate: every agent at a quarter of the updates, every agent at all of
    them, and a heterogeneous set (tool 1/8, kv 1/2, add all), as the paper's agents differ
    mainly in their number of updates (about 120, 450 and over 1,000)."""
    tag = f"lr{lr:.0e}".replace("e-0", "e-")

    def same(n: int) -> tuple[tuple[str, int], ...]:
        return tuple((t, n) for t in TASK_NAMES)

    het = {"add": most, "kv": most // 2, "tool": most // 8}
    return [
        Point(f"{tag}-all{most // 4}", lr, same(most // 4)),
        Point(f"{tag}-all{most}", lr, same(most)),
        Point(f"{tag}-het", lr, tuple((t, het[t]) for t in TASK_NAMES)),
    ]


# At every point: the main table's merges and the plain mean of the agents.
METHODS = (*MAIN_MERGES, *[m for m in SWEEP_MERGES if m[0] == "task_arithmetic@w=0.33"])
RAM_PLUS = dict(MAIN_MERGES)["ram_plus"]
# The paper's ablations of RAM+ (r; and eps, which the paper fixes at 1e-5 untested), at the
# sparsest point where every agent learned its task.
ABLATIONS = tuple(
    [
        (f"ram_plus@r={r}", ("--method", "ram_plus", "--r", r, "--alpha", "2.0"))
        for r in ("0", "0.05", "0.15", "0.2")
    ]
    + [(f"ram_plus@eps={e}", (*RAM_PLUS, "--eps", e)) for e in ("1e-6", "3e-6", "3e-5", "1e-4")]
)

FULL_SWEEP = Sweep(
    plan=replace(FULL, extra_merges=()),
    lrs=((1e-6, 40), (3e-6, 120), (1e-5, 120), (3e-5, 120)),
    methods=METHODS,
    ablations=ABLATIONS,
)
SMOKE_SWEEP = Sweep(
    plan=replace(SMOKE, rl_steps=4),
    lrs=((1e-3, 8),),
    methods=METHODS,
    ablations=ABLATIONS[:1] + ABLATIONS[-1:],
    smoke=True,
)


class Layout:
    """Where everything of a sweep lives in DIR."""

    def __init__(self, out: str) -> None:
        self.out = out

    def base(self, seed: int) -> str:
        return os.path.join(self.out, f"seed{seed}", "base")

    def trajectory(self, seed: int, lr: float, task: str) -> str:
        return os.path.join(self.out, f"seed{seed}", f"lr{lr:g}", f"agent-{task}")

    def agent(self, seed: int, lr: float, task: str, steps: int) -> str:
        return os.path.join(self.trajectory(seed, lr, task), f"step{steps}")

    def point(self, seed: int, point: str) -> str:
        return os.path.join(self.out, f"seed{seed}", "points", point)

    def merged(self, seed: int, point: str, method: str) -> str:
        folder = method.replace("@", "-").replace("=", "")
        return os.path.join(self.point(seed, point), "merged", folder)


def done(folder: str, kind: str = "job") -> bool:
    return os.path.isfile(record(folder, kind))


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def merge_point(cli: CliRunner, lay: Layout, seed: int, point: Point, merges: tuple) -> list[str]:
    """`ram-dist probe`, then the merges for one point and seed: the main table's as one
    `ram-dist merge` sweep into the point's merged/ (each variant's folder merged/METHOD),
    any other as its own merge (task arithmetic at w=0.33 takes a weight that ties and DARE
    would take too in one sweep; the ablations run after the sweep's points are scored); the
    merged folders not yet scored."""
    inputs = ["--base", lay.base(seed)]
    for t in TASK_NAMES:
        inputs += ["--task", lay.agent(seed, point.lr, t, point.updates(t))]
    root = lay.point(seed, point.name)
    os.makedirs(root, exist_ok=True)
    probe_json = os.path.join(root, "probe.json")
    if not done(os.path.join(root, "probe"), "command"):
        rec = cli(["probe", *inputs, "--json", probe_json], f"seed{seed}-{point.name}-probe")
        write_json(record(os.path.join(root, "probe"), "command"), rec)
    swept = {name for name, _ in merges if name in MAIN_SWEEP[2].values()}
    if swept and not all(done(lay.merged(seed, point.name, n), "command") for n in swept):
        out = os.path.join(root, "merged")
        made = run_sweep(cli, inputs, out, MAIN_SWEEP, seed, f"seed{seed}-{point.name}-sweep")
        for name, rec in made.items():
            folder = lay.merged(seed, point.name, name)
            assert os.path.samefile(rec["folder"], folder), (rec, folder)
            write_json(record(folder, "command"), {**rec, "folder": folder})
    folders = []
    for name, flags in merges:
        folder = lay.merged(seed, point.name, name)
        if not done(folder, "command"):
            rec = cli(
                merge_argv(inputs, folder, flags, seed),
                f"seed{seed}-{point.name}-{os.path.basename(folder)}",
            )
            write_json(record(folder, "command"), rec)
        folders.append(folder)
    return [f for f in folders if not done(f, "scores")]


def run(sweep: Sweep, out: str, points: list[Point], workers: int, cli_mode: str, ablate: bool):
    plan, lay = sweep.plan, Layout(out)
    t0 = time.perf_counter()
    seeds = plan.seeds
    # Each (seed, lr, task) trajectory saves the agents of every selected point, and those of
    # the sweep's other points that it passes on the way (a later run need not train them).
    snaps, wanted = _snapshots(points), _snapshots(sweep.points)
    needed = {k: set(v) for k, v in snaps.items()}
    for key, steps in snaps.items():
        steps.update(n for n in wanted[key] if n <= max(steps))
    cli = CliRunner(cli_mode, os.path.join(out, "logs"))
    pending: dict[Future, tuple] = {}
    merged: set[tuple[int, str]] = set()
    ablated = False

    def ready(seed: int, p: Point) -> bool:
        return all(done(lay.agent(seed, p.lr, t, p.updates(t))) for t in TASK_NAMES)

    with ProcessPoolExecutor(
        workers, mp_context=get_context("spawn"), initializer=init_worker
    ) as pool:

        def submit(kind: str, *args: object) -> None:
            fn = {"sft": sft_job, "rl": rl_snapshots_job, "eval": eval_job}[kind]
            pending[pool.submit(fn, plan, *args)] = (kind, *args)

        def score(folder: str, seed: int) -> None:
            if not done(folder, "scores"):
                submit("eval", seed, folder)

        def trajectories(seed: int) -> None:
            # Longest first, so that no long run starts last.
            for (lr, t), steps in sorted(snaps.items(), key=lambda kv: -max(kv[1])):
                folders = {n: lay.agent(seed, lr, t, n) for n in sorted(steps)}
                if all(done(folders[n]) for n in needed[(lr, t)]):
                    for n in sorted(needed[(lr, t)]):
                        score(folders[n], seed)
                else:
                    submit("rl", seed, t, lay.base(seed), lr, folders)

        def merge_ready(seed: int) -> None:
            for p in points:
                if (seed, p.name) not in merged and ready(seed, p):
                    merged.add((seed, p.name))
                    for f in merge_point(cli, lay, seed, p, sweep.methods):
                        score(f, seed)
                    log(f"seed {seed}: {p.name} probed and merged", t0)

        for s in seeds:
            if not done(lay.base(s)):
                submit("sft", s, lay.base(s))
        try:
            cli.start()
            for s in seeds:
                if done(lay.base(s)):
                    score(lay.base(s), s)
                    trajectories(s)
                    merge_ready(s)
            while pending or (ablate and not ablated):
                if not pending:
                    # Every point is scored: the ablations, at the point the rule picks.
                    ablated = True
                    res = collect(out, sweep, points, lay)
                    name = ablation_point(res)
                    p = next(q for q in points if q.name == name)
                    log(f"ablations at {name}", t0)
                    for s in seeds:
                        for f in merge_point(cli, lay, s, p, sweep.ablations):
                            score(f, s)
                    continue
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in finished:
                    kind, seed, *rest = pending.pop(fut)
                    res = fut.result()
                    if kind == "sft":
                        write_json(record(lay.base(seed)), res)
                        log(f"seed {seed}: base trained ({res['wall_s']:.0f} s)", t0)
                        score(lay.base(seed), seed)
                        trajectories(seed)
                    elif kind == "rl":
                        task, _base, lr, folders = rest
                        for n, f in folders.items():
                            write_json(record(f), {**res, "steps": n})
                            if n in needed[(lr, task)]:  # the others: when a run needs them
                                score(f, seed)
                        log(f"seed {seed}: {task} at lr {lr:g} ({res['wall_s']:.0f} s)", t0)
                        merge_ready(seed)
                    else:
                        write_json(record(rest[0], "scores"), res)
        finally:
            cli.stop()
    results = collect(out, sweep, points, lay)
    command = "python examples/rl-agents/sweep.py " + shlex.join(sys.argv[1:])
    runs = _runs(out) + [{"command": command, "wall_s": time.perf_counter() - t0}]
    write_json(os.path.join(out, "runs.json"), {"runs": runs})
    results.update(runs=runs, machine=machine(), command=command)
    write_sweep_outputs(results, out)
    log(f"done: {out}/SWEEP.md, {out}/sweep.json, {out}/regime_map.json", t0)
    return results


def _snapshots(points: list[Point]) -> dict[tuple[float, str], set[int]]:
    """The agents the points need: (learning rate, task) -> numbers of updates."""
    snaps: dict[tuple[float, str], set[int]] = {}
    for p in points:
        for t in TASK_NAMES:
            snaps.setdefault((p.lr, t), set()).add(p.updates(t))
    return snaps


def _runs(out: str) -> list[dict]:
    """Every earlier run in DIR that finished (a run resumes the ones before it)."""
    path = os.path.join(out, "runs.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)["runs"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="output folder (models, logs, results); shared by every point")
    p.add_argument("--smoke", action="store_true", help="a shrunken sweep: one seed, tiny model")
    p.add_argument("--point", action="append", help="run only this point (repeatable; --list)")
    p.add_argument("--list", action="store_true", help="print the points and exit")
    p.add_argument("--workers", type=int, default=2, help="training processes (1 thread each)")
    p.add_argument("--report-only", action="store_true", help="rewrite the outputs from DIR")
    p.add_argument("--cli", choices=("inprocess", "subprocess"), default="inprocess")
    p.add_argument(
        "--into", metavar="RESULTS_MD", help="then put SWEEP.md into this file's sweep block"
    )
    args = p.parse_args(argv)
    sweep = SMOKE_SWEEP if args.smoke else FULL_SWEEP
    if args.list:
        for q in sweep.points:
            steps = ", ".join(f"{t} {n}" for t, n in q.steps)
            print(f"{q.name}: lr {q.lr:g}; updates {steps}")
        return 0
    if not args.out:
        p.error("--out is required")
    out = os.path.abspath(args.out)
    names = {q.name for q in sweep.points}
    unknown = sorted(set(args.point or ()) - names)
    if unknown:
        p.error(f"unknown point(s) {unknown}; --list shows them")
    points = [q for q in sweep.points if not args.point or q.name in args.point]
    if args.report_only:
        previous = os.path.join(out, "sweep.json")
        results = collect(out, sweep, points, Layout(out))
        if os.path.isfile(previous):  # how the last run was made: its command and machine
            with open(previous, encoding="utf-8") as f:
                made = json.load(f)
            results.update({k: made[k] for k in ("machine", "command") if k in made})
        results["runs"] = _runs(out)
        write_sweep_outputs(results, out)
    else:
        os.makedirs(out, exist_ok=True)
        run(sweep, out, points, args.workers, args.cli, ablate=not args.point)
    if args.into:
        write_into(out, args.into)
    return 0


if __name__ == "__main__":
    sys.exit(main())
