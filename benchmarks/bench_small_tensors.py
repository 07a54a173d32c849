"""``ram-dist merge`` of a checkpoint made of many small tensors, as MoE checkpoints are.

A mixture-of-experts checkpoint holds tens of thousands of small tensors besides its large
ones: norms, router weights and biases, and one scale per FP8 weight. What a merge spends per
tensor (reads, hand-offs, kernel calls, the driver's bookkeeping), not per byte, sets its time
there. This benchmark writes (once; cached in ``--workdir`` and reused while the parameters
match) a bf16 base and ``--tasks`` agents of ``--tensors`` tensors of ``--elements`` elements
each, with MoE-like names (per layer two norms, a router weight and bias, then three scales
per expert; ``ram_dist.synthetic`` draws the values: the agents change a sparse share of the
elements), then runs ``ram-dist merge --base B --task T1 ... --out O --method ram_plus`` as
a subprocess (embedded local Ray) ``--repeats`` times, and prints a Markdown table of the
wall time and the per-pass times of ``merge_report.json``. With ``--previous-cli``, another
ram-dist (an older commit) runs in the same alternating rounds, and the outputs of the two
are compared byte for byte.

Example::

    python -m benchmarks.bench_small_tensors --tensors 100000 --repeats 3

from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.commands import cli_command
from benchmarks.inputs import safetensors_files
from benchmarks.running import check_output, dig, read_files, run_process
from ram_dist.synthetic.files import write_shards
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

#: Bumped whenever the same parameters would give other files.
GENERATOR_VERSION = 1
DTYPE = torch.bfloat16
EXPERTS = 256
PER_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
             "mlp.gate.e_score_correction_bias")  # fmt: skip
PER_EXPERT = ("gate_proj", "up_proj", "down_proj")
#: Figures of one run read from its report.
REPORT_KEYS = {
    "reduce_s": "passes.reduce.wall_s",
    "map_s": "passes.map.wall_s",
    "units": "passes.map.units",
    "tasks": "passes.map.tasks",
    "reduce_tasks": "passes.reduce.tasks",
}


def tensor_names(count: int) -> Iterator[str]:
    """`count` MoE-like names, layer by layer: per layer `PER_LAYER`, then per expert the
    scale of each of its `PER_EXPERT` weights."""
    made, layer = 0, 0
    while True:
        p = f"model.layers.{layer}."
        names = [p + n for n in PER_LAYER]
        names += [f"{p}mlp.experts.{e}.{w}.weight_scale_inv" for e in range(EXPERTS)
                  for w in PER_EXPERT]  # fmt: skip
        for name in names:
            if made == count:
                return
            yield name
            made += 1
        layer += 1


def roles(tasks: int) -> list[str]:
    return ["base"] + [f"agent{k + 1}" for k in range(tasks)]


def ensure_models(args: argparse.Namespace) -> Path:
    """Base and agents under `WORKDIR/models`, generated unless an identical set is there."""
    folder = args.workdir / "models"
    key = {"generator_version": GENERATOR_VERSION, "tensors": args.tensors,
           "elements": args.elements, "tasks": args.tasks, "seed": args.seed}  # fmt: skip
    manifest = folder / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("key") == key:
        if all((folder / r / "model.safetensors").is_file() for r in roles(args.tasks)):
            print(f"using cached checkpoints in {folder}", flush=True)
            return folder
    shutil.rmtree(folder, ignore_errors=True)
    names = list(tensor_names(args.tensors))
    layers = 1 + max(int(n.split(".")[2]) for n in names)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "num_hidden_layers": layers, "n_routed_experts": EXPERTS,
              "torch_dtype": "bfloat16"}  # fmt: skip
    print(f"generating base + {args.tasks} agents of {len(names):,} tensors of "
          f"{args.elements} element(s) in {folder}", flush=True)  # fmt: skip
    shape = (args.elements,)
    for k, role in enumerate(roles(args.tasks)):
        start = time.perf_counter()

        def tensor(name: str, agent: int = k - 1) -> torch.Tensor:
            base = base_tensor(name, shape, args.seed, DTYPE)
            if agent < 0:
                return base
            density = AGENT_DENSITIES[agent % len(AGENT_DENSITIES)]
            return task_tensor(base, name, density, args.seed + 1 + agent)

        write_shards(folder / role, [names], tensor, single_file=True)
        (folder / role / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"  {role}: {time.perf_counter() - start:.1f} s", flush=True)
    manifest.write_text(json.dumps({"key": key, "tensors": len(names)}, indent=2) + "\n")
    return folder


def command(cli: list[str], models: Path, out: Path, args: argparse.Namespace) -> list[str]:
    argv = [*cli, "merge", "--base", str(models / "base")]
    for role in roles(args.tasks)[1:]:
        argv += ["--task", str(models / role)]
    argv += ["--out", str(out), "--method", args.method, *args.merge_arg]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    return argv


def output_digest(out: Path) -> str:
    """sha256 over the output's safetensors files, in name order."""
    digest = hashlib.sha256()
    for path in safetensors_files(out):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def measure(
    name: str, cmd: list[str], env: dict, out: Path, log: Path, tensors: int
) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    wall, usage = run_process(cmd, env, log)
    report = json.loads((out / "merge_report.json").read_text())
    sample: dict[str, Any] = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}
    for key, dotted in REPORT_KEYS.items():
        sample[key] = dig(report, dotted)
    sample["passes_s"] = sample["reduce_s"] + sample["map_s"]
    sample["overhead_s"] = wall - sample["passes_s"]
    sample["digest"] = output_digest(out)
    check_output(out, tensors)  # every tensor written, or an error
    print(f"{name}: wall {wall:.2f} s, reduce {sample['reduce_s']:.2f} s, "
          f"map {sample['map_s']:.2f} s", flush=True)  # fmt: skip
    return sample


ROWS = [
    ("wall time", "wall_s"),
    ("reduce pass", "reduce_s"),
    ("map pass", "map_s"),
    ("reduce + map", "passes_s"),
    ("start-up, planning, shutdown", "overhead_s"),
    ("CPU time (the command and the processes it reaped)", "cpu_s"),
]


def print_table(samples: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    names = list(samples)
    print(f"\n{args.tensors:,} tensors of {args.elements} bf16 element(s), base + "
          f"{args.tasks} agents, `--method {args.method}`, {args.repeats} repeat(s)\n")  # fmt: skip
    print("| median | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, key in ROWS:
        cells = []
        for n in names:
            values = [s[key] for s in samples[n]]
            cells.append(f"{statistics.median(values):.2f} s")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for label, key in (("work units (map pass)", "units"), ("tasks (map pass)", "tasks"),
                       ("tasks (reduce pass)", "reduce_tasks")):  # fmt: skip
        print(f"| {label} | " + " | ".join(f"{samples[n][-1][key]:,}" for n in names) + " |")
    print("\n| samples | " + " | ".join(f"run {k + 1}" for k in range(args.repeats)) + " |")
    print("|---|" + "---:|" * args.repeats)
    for n in names:
        for label, key in (("wall", "wall_s"), ("reduce + map", "passes_s")):
            cells = " | ".join(f"{s[key]:.2f} s" for s in samples[n])
            print(f"| {n}: {label} | {cells} |")
    digests = {s["digest"] for ss in samples.values() for s in ss}
    same = "identical" if len(digests) == 1 else "DIFFERENT"
    print(f"\noutputs of every run: {same} (sha256 {sorted(digests)[0][:16]}...)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=100_000, help="tensors per checkpoint")
    p.add_argument("--elements", type=int, default=1, help="elements per tensor (1)")
    p.add_argument("--tasks", type=int, default=2, help="agents merged into the base (2)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ram-dist-bench-small"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--method", default="ram_plus")
    p.add_argument("--workers", type=int, default=None, help="ram-dist's --workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-arg", action="append", default=[], help="appended to every merge")
    p.add_argument("--cli", help='run this instead of ram-dist (e.g. "env PYTHONPATH=...")')
    p.add_argument("--previous-cli", help="another ram-dist, run in the same rounds as `previous`")
    p.add_argument("--json", type=Path, help="also write every sample here")
    p.add_argument("--generate-only", action="store_true")
    args = p.parse_args(argv)

    models = ensure_models(args)
    if args.generate_only:
        return 0
    read_files([q for r in roles(args.tasks) for q in safetensors_files(models / r)],
               bytearray(1 << 24))  # fmt: skip
    cli, env = cli_command(args.cli)
    runs = {"current": cli}
    if args.previous_cli:
        runs["previous"] = shlex.split(args.previous_cli)
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in runs}
    for r in range(args.repeats):
        order = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
        for name in order:
            out = args.workdir / "out" / name
            cmd = command(runs[name], models, out, args)
            log = args.workdir / f"{name}_{r + 1}.log"
            label = f"repeat {r + 1}: {name}"
            samples[name].append(measure(label, cmd, env, out, log, args.tensors))
    print_table(samples, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"workdir": str(args.workdir),
                                         "json": str(args.json)}, "samples": samples},
                                        indent=2, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
