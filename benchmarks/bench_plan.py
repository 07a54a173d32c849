"""Wall time and peak memory of ``ram-dist plan`` on a large base and its tasks.

Writes, in a temporary folder, checkpoints of one of five layouts (``--layout``) as sparse
files: each shard's real safetensors header, then ``truncate`` to its full size (holes, no
data). Then it runs ``ram-dist plan --base B --task T1 ... --unit-mb 256`` as a subprocess and
prints its wall time, CPU time and peak RSS (``os.wait4``) as a Markdown table, beside the
same for a bare import of ram-dist's modules (what every command pays first). Every
tensor-free step of a merge is in it: listing, index and header reads, the checks, the
layout, the parameters of every tensor, the plan of the work units, the report.

* ``llama-405b`` (the default): a base and three tasks with the real Llama-3.1-405B layout
  (126 layers, hidden 16384, 128 heads, 8 KV heads, intermediate 53248, vocab 128256, untied
  ``lm_head``, bf16; Hugging Face ``LlamaForCausalLM`` names), 191 shards each with a
  ``model.safetensors.index.json`` (1,137 tensors; about 4.2 GB of holes a shard). The shards
  hold consecutive tensors, about equal in bytes (the real checkpoint's split differs a
  little). Target: at most 5 s and 1 GiB.
* ``deepseek-v3``: a base and three tasks with DeepSeek-V3's published layout
  (``ram_dist.synthetic.deepseek``: 91,991 tensors, 45,808 of them FP8 with their F32 block
  scales, 163 shards and a ``config.json`` with its ``quantization_config``). Target: at most
  10 s and 2 GiB.
* ``gpt-oss-120b``: gpt-oss-120b's published base and three bf16 agents
  (``ram_dist.synthetic.gpt_oss``): the base's 687 tensors (36 layers of 128 experts, the
  expert weights MXFP4 ``_blocks``/``_scales`` pairs, everything else bf16) in 15 shards
  ``model-00000-of-00014.safetensors`` ... with the published ``quantization_config``; each
  agent's 615 bf16 tensors (the experts' weights by their decoded names and shapes) in 72
  shards of at most 5 GB, as ``save_pretrained`` writes them. Target: at most 10 s and 1 GiB.
* ``kimi-k2-thinking``: Kimi-K2-Thinking's published base and three bf16 agents
  (``ram_dist.synthetic.kimi``): the base's 208,215 tensors (DeepSeek-V3's names, 61 layers,
  60 of them with 384 routed experts, each expert's gate, up and down a compressed-tensors
  INT4 triple ``weight_packed``/``weight_scale``/``weight_shape``, everything else bf16) in 62
  shards ``model-00001-of-000062.safetensors`` ... with the published ``quantization_config``;
  each agent's 69,975 bf16 tensors (the experts' weights as ``.weight``) in 412 shards of at
  most 5 GB, as ``save_pretrained`` writes them. Target: at most 10 s and 1 GiB.
* ``small-100k``: a base and two tasks of 100,000 tensors of one bf16 element each
  (``model.layers.L.wJ.weight``, 1,000 layers of 100), in 4 shards each: the cost per tensor,
  with nothing else in it.

Example::

    python -m benchmarks.bench_plan --repeats 3
    python -m benchmarks.bench_plan --layout deepseek-v3 --profile /tmp/plan.prof
    python -m benchmarks.bench_plan --layout gpt-oss-120b
    python -m benchmarks.bench_plan --layout kimi-k2-thinking
    python -m pstats /tmp/plan.prof   # then: sort cumtime, stats 30

from the repository root. The layouts and the sparse files are `ram_dist.synthetic`'s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.commands import cli_command
from benchmarks.running import run_process
from ram_dist.io.checkpoint import INDEX_NAME
from ram_dist.synthetic import deepseek, gpt_oss
from ram_dist.synthetic.deepseek import DEEPSEEK_V3, split_evenly
from ram_dist.synthetic.files import shard_name, write_sparse_checkpoint
from ram_dist.synthetic.gpt_oss import GPT_OSS_120B
from ram_dist.synthetic.kimi import KIMI_K2_THINKING
from ram_dist.synthetic.llama import LLAMA_3_1_405B

SHARDS = 191
ROLES = ("base", "task1", "task2", "task3")
Tensors = list[tuple[str, tuple[int, ...]]]
#: `small-100k`: layers of tensors of one element, and the shards of each checkpoint.
SMALL_LAYERS, SMALL_PER_LAYER, SMALL_SHARDS = 1000, 100, 4
#: What every `ram-dist` command imports before it does anything (torch, Ray, numba).
IMPORTS = "import ram_dist.cli, ram_dist.engine.driver, ram_dist.report.text"
#: `--profile`: the command's `main` under cProfile, its statistics written to `argv[1]`
#: (`python -m cProfile` would write nothing: the `ram-dist` executable ends with `os._exit`).
PROFILED = (
    f"import cProfile, sys; {IMPORTS}; from ram_dist.cli import main; "
    "cProfile.run('main(sys.argv[2:])', sys.argv[1])"
)


def shard(tensors: Tensors) -> list[Tensors]:
    """`SHARDS` shards of consecutive bf16 tensors, about equal in bytes: a tensor goes to the
    shard its first byte falls in. No tensor is larger than a shard's share, so none is empty."""
    shards = split_evenly([(n, shape, "BF16") for n, shape in tensors], SHARDS)
    return [[(n, shape) for n, shape, _ in s] for s in shards]


@dataclass(frozen=True)
class Layout:
    """What `--layout` writes: the shards of every checkpoint, the roles (base first); the
    tasks' own (`task_*`) where they are not the base's."""

    title: str
    roles: tuple[str, ...]
    shards: Callable[[], list]
    config: dict[str, Any] | None = None
    name: Callable[[int, int], str] = shard_name
    task_shards: Callable[[], list] | None = None
    task_config: dict[str, Any] | None = None
    task_name: Callable[[int, int], str] = shard_name

    def write(self, folders: list[Path]) -> None:
        """The base in `folders[0]`, the tasks in the others (each folder emptied first)."""
        base = self.shards()
        tasks = self.task_shards() if self.task_shards is not None else None
        for k, f in enumerate(folders):
            shutil.rmtree(f, ignore_errors=True)
            if k == 0 or tasks is None:
                write_sparse_checkpoint(f, base, config=self.config, name=self.name)
            else:
                write_sparse_checkpoint(f, tasks, config=self.task_config, name=self.task_name)


def small_shards() -> list[Tensors]:
    """`small-100k`: 100,000 tensors of one element, in `SMALL_SHARDS` shards."""
    names = [
        f"model.layers.{layer}.w{k}.weight"
        for layer in range(SMALL_LAYERS)
        for k in range(SMALL_PER_LAYER)
    ]
    per = -(-len(names) // SMALL_SHARDS)
    return [[(n, (1,)) for n in names[i : i + per]] for i in range(0, len(names), per)]


LAYOUTS = {
    "llama-405b": Layout(
        "Llama-3.1-405B layout, base + 3 tasks", ROLES, lambda: shard(LLAMA_3_1_405B.tensors())
    ),
    "deepseek-v3": Layout(
        "DeepSeek-V3 layout (FP8), base + 3 tasks",
        ROLES,
        DEEPSEEK_V3.shards,
        DEEPSEEK_V3.config(),
        deepseek.shard_name,
    ),
    "gpt-oss-120b": Layout(
        "gpt-oss-120b layout, MXFP4 base + 3 bf16 agents",
        ROLES,
        GPT_OSS_120B.shards,
        GPT_OSS_120B.config(),
        gpt_oss.shard_name,
        lambda: GPT_OSS_120B.shards(mxfp4=False),
        GPT_OSS_120B.config(mxfp4=False),
    ),
    "kimi-k2-thinking": Layout(
        "Kimi-K2-Thinking layout, INT4 base + 3 bf16 agents",
        ROLES,
        KIMI_K2_THINKING.shards,
        KIMI_K2_THINKING.config(),
        deepseek.shard_name,
        lambda: KIMI_K2_THINKING.shards(int4=False),
        KIMI_K2_THINKING.config(int4=False),
    ),
    "small-100k": Layout(
        "100,000 tensors of one bf16 element, base + 2 tasks", ROLES[:3], small_shards
    ),
}


def _measure(cmd: list[str], env: dict[str, str], log: Path) -> list[float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS MiB of one run of `cmd`."""
    wall, usage = run_process(cmd, env, log)
    return [wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024]  # maxrss: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layout", choices=sorted(LAYOUTS), default="llama-405b", help="what to plan"
    )
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--repeats", type=int, default=3, help="runs of `ram-dist plan` (3)")
    parser.add_argument("--unit-mb", default="256", help="`--unit-mb` of the plan (256)")
    parser.add_argument("--cli", help='run this instead of ram-dist (e.g. "env PYTHONPATH=...")')
    parser.add_argument("--profile", help="run once more under cProfile, writing this file")
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plan-"))
    try:
        layout = LAYOUTS[args.layout]
        folders = [root / args.layout / role for role in layout.roles]
        if not all((f / INDEX_NAME).exists() for f in folders):  # else: written by an earlier run
            layout.write(folders)
        paths = [p for f in folders for p in f.glob("*.safetensors")]
        files, logical = len(paths), sum(p.stat().st_size for p in paths)
        cmd, env = cli_command(args.cli)
        argv = ["plan", "--base", str(folders[0])]
        for f in folders[1:]:
            argv += ["--task", str(f)]
        argv += ["--unit-mb", args.unit_mb]
        imports = None if args.cli else [sys.executable, "-c", IMPORTS]
        rows: list[list[float]] = []
        for k in range(args.repeats):
            row = _measure([*cmd, *argv], env, root / args.layout / f"plan-{k}.log")
            if imports is not None:
                row += _measure(imports, env, root / args.layout / f"imports-{k}.log")
            rows.append(row)
        if args.profile:
            if args.cli:
                raise SystemExit("--profile runs this interpreter's ram_dist; drop --cli")
            profiled = [sys.executable, "-c", PROFILED, os.path.abspath(args.profile)]
            run_process([*profiled, *argv], env, root / args.layout / "plan-profile.log")
        print(
            f"{layout.title}: {files} files, "
            f"{logical / 1e12:.2f} TB logical (sparse), `--unit-mb {args.unit_mb}`\n"
        )
        print(
            "| run | `plan` wall s | CPU s | peak RSS MiB "
            "| imports only: wall s | CPU s | peak RSS MiB |"
        )
        print("|---|---|---|---|---|---|---|")
        medians = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
        for name, row in [*((str(k), r) for k, r in enumerate(rows, start=1)), ("median", medians)]:
            cells = [f"{v:.0f}" if i % 3 == 2 else f"{v:.2f}" for i, v in enumerate(row)]
            print(f"| {name} | " + " | ".join(cells + ["-"] * (6 - len(cells))) + " |")
        print()
        for line in (root / args.layout / "plan-0.log").read_text().splitlines():
            if line.startswith(("tensors:", "work units:")):
                print(line)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
