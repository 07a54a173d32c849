"""Train small RL agents from one base, merge them with every method, measure every task.

    python examples/rl-agents/run.py --out DIR           # the full run (3 seeds)
    python examples/rl-agents/run.py --out DIR --smoke   # a shrunken run, every step once

Per seed: supervised base on the task mixture -> one GRPO agent per task (bf16) ->
`ram-dist probe` -> `ram-dist merge` with every method -> greedy evaluation of the base, the
agents and the merges on every task's held-out set. Writes DIR/results.json and
DIR/RESULTS.md. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rl_jobs import Plan, bf16_steps, eval_job, init_worker, rl_job, sft_job  # noqa: E402
from rl_model import Size  # noqa: E402
from rl_report import write_results_md  # noqa: E402
from rl_tasks import TASK_NAMES, TASKS, CharTokenizer  # noqa: E402

# The merges of the main table: (name, ram-dist flags). Fixed before any result was seen,
# the same for every seed; see README.md for why these values.
MAIN_MERGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("task_arithmetic", ("--method", "task_arithmetic")),
    ("ties", ("--method", "ties", "--density", "0.2")),
    ("dare_ties", ("--method", "dare_ties", "--density", "0.2")),
    ("ram", ("--method", "ram")),
    ("ram_plus", ("--method", "ram_plus", "--r", "0.1", "--alpha", "2.0")),
    ("ram_plus_soft", ("--method", "ram_plus_soft", "--r", "0.1")),
)
# Sensitivity (full run only): each method's own knob over a grid, every method alike.
SWEEP_MERGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("task_arithmetic@w=0.33", ("--method", "task_arithmetic", "--weight", "0.3333333")),
    ("task_arithmetic@w=0.5", ("--method", "task_arithmetic", "--weight", "0.5")),
    ("ties@d=0.1", ("--method", "ties", "--density", "0.1")),
    ("ties@d=0.5", ("--method", "ties", "--density", "0.5")),
    ("dare_ties@d=0.1", ("--method", "dare_ties", "--density", "0.1")),
    ("dare_ties@d=0.5", ("--method", "dare_ties", "--density", "0.5")),
    ("dare_ties@d=0.9", ("--method", "dare_ties", "--density", "0.9")),
    ("ram_plus@r=0.05", ("--method", "ram_plus", "--r", "0.05", "--alpha", "2.0")),
    ("ram_plus@r=0.2", ("--method", "ram_plus", "--r", "0.2", "--alpha", "2.0")),
    ("ram_plus@r=0.5", ("--method", "ram_plus", "--r", "0.5", "--alpha", "2.0")),
)

# The merges above as `ram-dist merge` sweeps (docs/sweeps.md): (folder under seedN/merged,
# flags, {variant folder: merge name}). The main table is one sweep: each method takes the
# flags it declares (ties and dare_ties `--density`, the RAM family `--r`/`--alpha`, whose
# values are `ram`'s and `ram_plus_soft`'s defaults), so every variant is its merge above and
# its folder seedN/merged/METHOD. The grid of each method's knob is one sweep per method: a
# sweep crosses every method with every grid name it declares (ties with the weights too).
MAIN_SWEEP = (
    ".",
    (*[f for m, _ in MAIN_MERGES for f in ("--method", m)], "--density", "0.2", "--r", "0.1",
     "--alpha", "2.0"),
    {m: m for m, _ in MAIN_MERGES},
)  # fmt: skip
SENSITIVITY_SWEEPS = (
    ("sensitivity-task_arithmetic", ("--method", "task_arithmetic", "--grid",
     "weight=0.3333333,0.5"), {"task_arithmetic-weight0.3333333": "task_arithmetic@w=0.33",
     "task_arithmetic-weight0.5": "task_arithmetic@w=0.5"}),
    ("sensitivity-ties", ("--method", "ties", "--grid", "density=0.1,0.5"),
     {"ties-density0.1": "ties@d=0.1", "ties-density0.5": "ties@d=0.5"}),
    ("sensitivity-dare_ties", ("--method", "dare_ties", "--grid", "density=0.1,0.5,0.9"),
     {f"dare_ties-density{d}": f"dare_ties@d={d}" for d in ("0.1", "0.5", "0.9")}),
    ("sensitivity-ram_plus", ("--method", "ram_plus", "--alpha", "2.0", "--grid",
     "r=0.05,0.2,0.5"), {f"ram_plus-r{r}": f"ram_plus@r={r}" for r in ("0.05", "0.2", "0.5")}),
)  # fmt: skip

# Addition is the slowest skill to learn, so it gets every other supervised step.
SFT_MIXTURE = ("add", "kv", "add", "tool")

FULL = Plan(
    size=Size(hidden=256, layers=3, heads=8, kv_heads=2, intermediate=704),
    sft_steps=1500,
    sft_batch=64,
    sft_lr=1e-3,
    sft_mixture=SFT_MIXTURE,
    rl_steps=120,
    rl_prompts=16,
    rl_group=8,
    rl_lr=3e-5,
    eval_n=400,
    seeds=(0, 1, 2),
    extra_merges=SWEEP_MERGES,
)
SMOKE = Plan(
    size=Size(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64),
    sft_steps=300,
    sft_batch=32,
    sft_lr=1e-2,
    sft_mixture=SFT_MIXTURE,
    rl_steps=4,
    rl_prompts=8,
    rl_group=4,
    rl_lr=1e-3,
    eval_n=32,
    seeds=(0,),
    extra_merges=(),
)


class CliRunner:
    """Runs `ram-dist` command lines. In-process (default): `ram_dist.cli.main(argv)`, the
    entry point of the `ram-dist` command, in this process, where one local Ray is started
    once for the whole run (a separate `ram-dist` process starts its own Ray each time,
    ~10 s here). `subprocess`: `python -m ram_dist.cli ARGV`, each with its embedded Ray."""

    def __init__(self, mode: str, log_dir: str) -> None:
        self.mode, self.log_dir, self.ray_started = mode, log_dir, False
        os.makedirs(log_dir, exist_ok=True)

    def start(self) -> None:
        if self.mode == "inprocess":
            import logging

            import ray

            ray.init(  # its own: not a Ray that another program started on this machine
                address="local",
                num_cpus=2,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            self.ray_started = True

    def stop(self) -> None:
        if self.ray_started:
            import ray

            ray.shutdown()
            self.ray_started = False

    def __call__(self, argv: list[str], name: str) -> dict:
        log = os.path.join(self.log_dir, f"{name}.log")
        t0 = time.perf_counter()
        if self.mode == "inprocess":
            from ram_dist import cli

            with (
                open(log, "w", encoding="utf-8") as f,
                contextlib.redirect_stdout(f),
                contextlib.redirect_stderr(f),
            ):
                rc = cli.main(argv)
        else:
            with open(log, "w", encoding="utf-8") as f:
                rc = subprocess.run(
                    [sys.executable, "-m", "ram_dist.cli", *argv], stdout=f, stderr=f
                ).returncode
        wall = time.perf_counter() - t0
        if rc != 0:
            with open(log, encoding="utf-8") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"ram-dist {shlex.join(argv)} exited {rc}:\n{tail}")
        return {"command": "ram-dist " + shlex.join(argv), "wall_s": wall, "log": log}


def seed_dirs(out: str, seed: int) -> dict[str, str]:
    root = os.path.join(out, f"seed{seed}")
    dirs = {"root": root, "base": os.path.join(root, "base")}
    for t in TASK_NAMES:
        dirs[f"agent-{t}"] = os.path.join(root, f"agent-{t}")
    return dirs


def merge_argv(inputs: list[str], folder: str, flags: tuple[str, ...], seed: int) -> list[str]:
    """One `ram-dist merge` command line (a sweep's too); DARE's random masks take the
    pipeline's seed."""
    argv = ["merge", *inputs, "--out", folder, "--overwrite", *flags]
    return argv + (["--seed", str(seed)] if any("dare" in f for f in flags) else [])


def run_sweep(
    cli: CliRunner, inputs: list[str], out: str, sweep: tuple, seed: int, log_name: str
) -> dict[str, dict]:
    """One `ram-dist merge` sweep into `out`: each merge's name, with the sweep's command
    line, wall time and log, and its variant's folder."""
    _, flags, names = sweep
    rec = cli(merge_argv(inputs, out, flags, seed), log_name)
    with open(os.path.join(out, "sweep_report.json"), encoding="utf-8") as f:
        variants = {os.path.basename(v["out"]): v["out"] for v in json.load(f)["variants"]}
    if set(variants) != set(names):
        raise RuntimeError(f"{rec['command']} made {sorted(variants)}, not {sorted(names)}")
    return {names[v]: {**rec, "folder": folder} for v, folder in variants.items()}


def merge_seed(cli: CliRunner, out: str, seed: int, sweeps: list[tuple]) -> tuple[dict, dict]:
    """`ram-dist probe`, then the merges of every method as `ram-dist merge` sweeps, for one
    seed."""
    d = seed_dirs(out, seed)
    inputs = ["--base", d["base"]]
    for t in TASK_NAMES:
        inputs += ["--task", d[f"agent-{t}"]]
    probe_json = os.path.join(d["root"], "probe.json")
    probe = cli(["probe", *inputs, "--json", probe_json], f"seed{seed}-probe")
    with open(probe_json, encoding="utf-8") as f:
        probe["report"] = json.load(f)
    probe["figure"] = probe_json[: -len(".json")] + ".figure2.png"
    done = {}
    for sweep in sweeps:
        folder = os.path.normpath(os.path.join(d["root"], "merged", sweep[0]))
        name = f"seed{seed}-{os.path.basename(folder)}"
        done.update(run_sweep(cli, inputs, folder, sweep, seed, name))
    return probe, done


def run(args: argparse.Namespace) -> dict:
    if args.report_only:
        with open(os.path.join(args.out, "results.json"), encoding="utf-8") as f:
            results = json.load(f)
        write_results_md(results, os.path.join(args.out, "RESULTS.md"))
        return results
    plan = SMOKE if args.smoke else FULL
    if args.seeds is not None:
        plan = Plan(**{**plan.__dict__, "seeds": tuple(range(args.seeds))})
    merges = list(MAIN_MERGES) + ([] if args.no_sweep else list(plan.extra_merges))
    sweeps = [MAIN_SWEEP] + ([] if args.no_sweep or not plan.extra_merges else
                             list(SENSITIVITY_SWEEPS))  # fmt: skip
    swept = [name for sweep in sweeps for name in sweep[2].values()]
    assert sorted(swept) == sorted(m for m, _ in merges), (swept, merges)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    results: dict = {
        "smoke": args.smoke,
        "plan": plan.to_json(),
        "tasks": {n: {"skill": t.skill, "prompt_width": t.prompt_width} for n, t in TASKS.items()},
        "tokenizer": CharTokenizer().to_json(),
        "main_methods": [m for m, _ in MAIN_MERGES],
        "sweep_methods": [m for m, _ in merges if m not in dict(MAIN_MERGES)],
        "models": ["base", *[f"agent-{t}" for t in TASK_NAMES], *[m for m, _ in merges]],
        "scores": {},
        "training": {},
        "probe": {},
        "merges": {},
        "eval_wall_s": {},
    }
    cli = CliRunner(args.cli, os.path.join(out, "logs"))
    ctx = get_context("spawn")
    pending: dict[Future, tuple] = {}
    rl_done: dict[int, set[str]] = {s: set() for s in plan.seeds}

    def record_score(seed: int, model: str, res: dict) -> None:
        for task, score in res["scores"].items():
            results["scores"].setdefault(model, {}).setdefault(task, {})[str(seed)] = score
        results["eval_wall_s"].setdefault(str(seed), {})[model] = res["wall_s"]

    with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=init_worker) as pool:

        def submit(kind: str, seed: int, *rest: object) -> None:
            fn = {"sft": sft_job, "rl": rl_job, "eval": eval_job}[kind]
            pending[pool.submit(fn, plan, seed, *rest)] = (kind, seed, *rest)

        for s in plan.seeds:
            submit("sft", s, seed_dirs(out, s)["base"])
        try:
            cli.start()  # Ray starts while the bases train
            while pending:
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in finished:
                    kind, seed, *rest = pending.pop(fut)
                    res = fut.result()
                    d = seed_dirs(out, seed)
                    tr = results["training"].setdefault(str(seed), {})
                    if kind == "sft":
                        tr["sft"] = res
                        submit("eval", seed, d["base"])
                        for t in TASK_NAMES:
                            submit("rl", seed, t, d["base"], d[f"agent-{t}"])
                        log(f"seed {seed}: base trained ({res['wall_s']:.0f} s)", t_start)
                    elif kind == "rl":
                        task = rest[0]
                        tr.setdefault("rl", {})[task] = res
                        submit("eval", seed, d[f"agent-{task}"])
                        rl_done[seed].add(task)
                        log(f"seed {seed}: agent-{task} trained ({res['wall_s']:.0f} s)", t_start)
                        if rl_done[seed] == set(TASK_NAMES):
                            probe, done = merge_seed(cli, out, seed, sweeps)
                            probe["bf16_steps"] = {
                                t: bf16_steps(d["base"], d[f"agent-{t}"]) for t in TASK_NAMES
                            }
                            results["probe"][str(seed)] = probe
                            results["merges"][str(seed)] = done
                            for info in done.values():
                                submit("eval", seed, info["folder"])
                            log(f"seed {seed}: probed and merged {len(done)} ways", t_start)
                    else:
                        merged = results["merges"].get(str(seed))
                        record_score(seed, model_name(rest[0], merged), res)
        finally:
            cli.stop()
    results["wall_s"] = time.perf_counter() - t_start
    results["machine"] = machine()
    results["command"] = "python examples/rl-agents/run.py " + shlex.join(sys.argv[1:])
    fig = results["probe"][str(plan.seeds[0])]["figure"]
    shutil.copyfile(fig, os.path.join(out, "figure2.png"))
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    write_results_md(results, os.path.join(out, "RESULTS.md"))
    log(f"done: {out}/results.json, {out}/RESULTS.md", t_start)
    return results


def model_name(folder: str, merges: dict | None) -> str:
    for name, info in (merges or {}).items():
        if info["folder"] == folder:
            return name
    return os.path.basename(folder)


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_at_end": load,
    }


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (models, logs, results)")
    p.add_argument("--smoke", action="store_true", help="a shrunken run: one seed, tiny model")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3; smoke 1)")
    p.add_argument("--workers", type=int, default=2, help="training processes (1 thread each)")
    p.add_argument("--no-sweep", action="store_true", help="main-table merges only")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite OUT/RESULTS.md from OUT/results.json"
    )
    p.add_argument(
        "--cli",
        choices=("inprocess", "subprocess"),
        default="inprocess",
        help="how ram-dist command lines run (see CliRunner); the bytes are the same",
    )
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
