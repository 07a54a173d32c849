"""End-to-end benchmark of ``ram-dist merge`` against a plain-I/O floor.

What it does, in one run:

1. Generates (once; cached in ``--workdir`` and reused when the parameters match) a synthetic
   bf16 Llama-like base checkpoint and three "RL agents" fine-tuned from it. Each agent has a
   sparse task vector with an independent, seeded Bernoulli mask (densities about 3 %, 46 %
   and 54 %, as reported for RL-trained agents) and changes large enough to survive bf16
   rounding and the merge's ``eps = 1e-5`` threshold. Generation works tensor by tensor and
   holds at most one output shard in memory.
2. Warms the page cache by reading every input once, then alternates, ``--repeats`` times:

   * the I/O floor: read every input byte twice (the merge has a reduce pass and a map pass,
     each reading all inputs), with plain buffered 16 MiB reads, and write as many bytes as
     the base's safetensors files once (no fsync, like the merge);
   * the merge: ``ram-dist merge`` as a subprocess, wall time measured from outside, with
     ``OUT/merge_report.json`` read afterwards for per-pass times, bytes and peak memory.

3. Prints medians (and every sample) as a table; ``--json FILE`` writes the same as JSON.

Example::

    python benchmarks/bench_merge.py --params 0.5e9 --workdir /tmp/ramdist-bench --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

GENERATOR_VERSION = 1
AGENT_DENSITIES = (0.03, 0.46, 0.54)
DTYPE = torch.bfloat16
DTYPE_BYTES = 2
READ_BLOCK = 16 * 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------
# Model layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the synthetic model: its name, shape and kind (``matrix`` or ``norm``)."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Layout:
    """Llama-like architecture chosen to hit a parameter budget, plus its shard plan."""

    hidden: int
    intermediate: int
    kv_dim: int
    layers: int
    vocab: int
    tensors: list[TensorSpec] = field(default_factory=list)
    shards: list[list[TensorSpec]] = field(default_factory=list)

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def shard_file(self, index: int) -> str:
        if len(self.shards) == 1:
            return "model.safetensors"
        return f"model-{index + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.hidden // 64,
            "num_key_value_heads": self.kv_dim // 64,
            "vocab_size": self.vocab,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }


def _round64(x: float) -> int:
    return max(64, int(round(x / 64)) * 64)


def plan_layout(params: float, shard_bytes: int) -> Layout:
    """Pick Llama-like dimensions whose parameter count is close to ``params``."""
    hidden = min(8192, _round64(math.sqrt(params / 300)))
    intermediate = _round64(hidden * 8 / 3)
    kv_dim = max(64, hidden // 4)
    vocab = 32000 if params >= 1e8 else 8000
    per_layer = 2 * hidden * hidden + 2 * kv_dim * hidden + 3 * hidden * intermediate + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((params - fixed) / per_layer))
    layout = Layout(hidden, intermediate, kv_dim, layers, vocab)
    layout.tensors = list(_tensor_specs(layout))
    layout.shards = _plan_shards(layout.tensors, shard_bytes)
    return layout


def _tensor_specs(lay: Layout) -> Iterator[TensorSpec]:
    h, i, kv = lay.hidden, lay.intermediate, lay.kv_dim
    yield TensorSpec("model.embed_tokens.weight", (lay.vocab, h), "matrix")
    for n in range(lay.layers):
        p = f"model.layers.{n}."
        yield TensorSpec(p + "input_layernorm.weight", (h,), "norm")
        yield TensorSpec(p + "self_attn.q_proj.weight", (h, h), "matrix")
        yield TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "matrix")
        yield TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "matrix")
        yield TensorSpec(p + "self_attn.o_proj.weight", (h, h), "matrix")
        yield TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm")
        yield TensorSpec(p + "mlp.gate_proj.weight", (i, h), "matrix")
        yield TensorSpec(p + "mlp.up_proj.weight", (i, h), "matrix")
        yield TensorSpec(p + "mlp.down_proj.weight", (h, i), "matrix")
    yield TensorSpec("model.norm.weight", (h,), "norm")
    yield TensorSpec("lm_head.weight", (lay.vocab, h), "matrix")


def _plan_shards(tensors: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensors:
        nbytes = spec.numel * DTYPE_BYTES
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


# --------------------------------------------------------------------------------------------
# Synthetic checkpoint generation
# --------------------------------------------------------------------------------------------


def _generator(seed: int, *keys: int) -> torch.Generator:
    """A generator seeded from ``seed`` and small non-negative integer keys."""
    value = seed
    for key in keys:
        value = value * 1_000_003 + key
    g = torch.Generator()
    g.manual_seed(value & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def base_tensor(spec: TensorSpec, index: int, seed: int) -> torch.Tensor:
    """The base weights of one tensor, as float32 values exactly representable in bf16."""
    g = _generator(seed, 0, index)
    x = torch.randn(spec.shape, generator=g)
    if spec.kind == "norm":
        x.mul_(0.05).add_(1.0)
    else:
        x.mul_(0.02)
    return x.to(DTYPE).float()


def agent_tensor(base: torch.Tensor, index: int, agent: int, seed: int) -> torch.Tensor:
    """Base plus a sparse RL-like task vector, in bf16.

    The mask is Bernoulli(``AGENT_DENSITIES[agent]``) (drawn as ``z < Phi^-1(p)`` from a normal
    sample, which is cheaper than ``rand``). The change has magnitude at least
    ``1e-3 + |base| * 2**-6``: above the merge's eps and more than half a bf16 ulp of the
    result, so every masked element really differs from the base after rounding.
    """
    density = AGENT_DENSITIES[agent]
    g = _generator(seed, agent + 1, index)
    threshold = float(torch.special.ndtri(torch.tensor(density, dtype=torch.float64)))
    mask = torch.randn(base.shape, generator=g) < threshold
    z = torch.randn(base.shape, generator=g)
    magnitude = base.abs().mul_(2.0**-6).add_(1e-3).mul_(z.abs().mul_(0.5).add_(1.0))
    delta = torch.copysign(magnitude, z).mul_(mask)
    return base.add(delta).to(DTYPE)


def write_model(folder: Path, layout: Layout, seed: int, agent: int | None) -> None:
    """Write one checkpoint (base when ``agent`` is None), one shard in memory at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    index_of = {spec.name: i for i, spec in enumerate(layout.tensors)}
    weight_map: dict[str, str] = {}
    for shard_index, shard in enumerate(layout.shards):
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard:
            base = base_tensor(spec, index_of[spec.name], seed)
            if agent is None:
                tensors[spec.name] = base.to(DTYPE)
            else:
                tensors[spec.name] = agent_tensor(base, index_of[spec.name], agent, seed)
            del base
        file_name = layout.shard_file(shard_index)
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in tensors})
        del tensors
    if len(layout.shards) > 1:
        index = {
            "metadata": {"total_size": layout.params * DTYPE_BYTES},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(layout.config(), indent=2) + "\n")


def model_names() -> list[str]:
    return ["base"] + [f"agent{k + 1}" for k in range(len(AGENT_DENSITIES))]


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _manifest_key(params: float, shard_bytes: int, seed: int) -> dict[str, Any]:
    return {
        "generator_version": GENERATOR_VERSION,
        "params": params,
        "shard_bytes": shard_bytes,
        "seed": seed,
        "densities": list(AGENT_DENSITIES),
    }


def _cached(models_dir: Path, key: dict[str, Any]) -> bool:
    manifest = models_dir / "manifest.json"
    if not manifest.is_file():
        return False
    data = json.loads(manifest.read_text())
    if data.get("key") != key:
        return False
    for rel, size in data.get("files", {}).items():
        path = models_dir / rel
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def ensure_models(workdir: Path, params: float, shard_bytes: int, seed: int) -> Layout:
    """Generate base and agents under ``workdir/models`` unless an identical set is cached."""
    layout = plan_layout(params, shard_bytes)
    models_dir = workdir / "models"
    key = _manifest_key(params, shard_bytes, seed)
    if _cached(models_dir, key):
        print(f"using cached checkpoints in {models_dir}", flush=True)
        return layout
    shutil.rmtree(models_dir, ignore_errors=True)
    models_dir.mkdir(parents=True)
    print(
        f"generating base + {len(AGENT_DENSITIES)} agents: {layout.params / 1e9:.3f} B params "
        f"each (hidden {layout.hidden}, {layout.layers} layers, vocab {layout.vocab}, "
        f"{len(layout.shards)} shard(s)) in {models_dir}",
        flush=True,
    )
    for k, name in enumerate(model_names()):
        start = time.perf_counter()
        write_model(models_dir / name, layout, seed, None if k == 0 else k - 1)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", flush=True)
    files = {
        str(p.relative_to(models_dir)): p.stat().st_size
        for name in model_names()
        for p in sorted((models_dir / name).iterdir())
    }
    manifest = {"key": key, "params": layout.params, "files": files}
    (models_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return layout


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


def measure_floor(inputs: Sequence[Path], out_bytes: int, scratch: Path) -> dict[str, float]:
    """Time two full reads of the inputs plus one write of ``out_bytes``."""
    buf = bytearray(READ_BLOCK)
    start = time.perf_counter()
    read_files(inputs, buf)
    read_files(inputs, buf)
    t_read2 = time.perf_counter()
    write_bytes(scratch, out_bytes, buf)
    end = time.perf_counter()
    scratch.unlink()
    return {
        "floor_s": end - start,
        "floor_read_pass_s": (t_read2 - start) / 2,
        "floor_write_s": end - t_read2,
    }


# --------------------------------------------------------------------------------------------
# Merge run
# --------------------------------------------------------------------------------------------


def cli_command() -> tuple[list[str], dict[str, str]]:
    """The ``ram-dist`` command and its environment (adds the repo to PYTHONPATH if needed)."""
    env = dict(os.environ)
    exe = shutil.which(
        "ram-dist", path=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    )
    if exe:
        return [exe], env
    if importlib.util.find_spec("ram_dist") is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "ram_dist.cli"], env


def merge_argv(args: argparse.Namespace, models_dir: Path, out: Path) -> list[str]:
    argv = ["merge", "--base", str(models_dir / "base")]
    for name in model_names()[1:]:
        argv += ["--task", str(models_dir / name)]
    argv += ["--out", str(out), "--method", args.method, "--chunk-mb", str(args.chunk_mb)]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    return argv + list(args.merge_arg)


def run_merge(cmd: list[str], env: dict[str, str], out: Path, log: Path) -> dict[str, Any]:
    """Run one merge; return wall time, the process's own max RSS and the merge report.

    The command runs in the log's folder, not the caller's: ``python -m`` puts the working
    directory first on ``sys.path``, which would shadow a ``PYTHONPATH`` given with ``--cli``.
    """
    shutil.rmtree(out, ignore_errors=True)
    with open(log, "w") as log_f:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, cwd=log.parent, stdout=log_f, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"merge failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    report_path = out / "merge_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    out_bytes = sum(p.stat().st_size for p in safetensors_files(out))
    return {
        "wall_s": wall,
        "cli_maxrss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        "out_bytes": out_bytes,
        "report": report,
    }


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
    "driver_peak_rss_bytes": "memory.driver_peak_rss_bytes",
    "worker_peak_rss_bytes": "memory.worker_peak_rss_bytes",
}


def sample_from(floor: dict[str, float], merge: dict[str, Any]) -> dict[str, Any]:
    """Flatten one repeat into named figures (None where the report lacks a key)."""
    sample: dict[str, Any] = dict(floor)
    sample["merge_wall_s"] = merge["wall_s"]
    sample["cli_maxrss_bytes"] = merge["cli_maxrss_bytes"]
    sample["out_bytes"] = merge["out_bytes"]
    for name, dotted in REPORT_KEYS.items():
        value = dig(merge["report"], dotted)
        sample[name] = value if isinstance(value, (int, float)) else None
    passes = [sample["reduce_s"], sample["map_s"]]
    sample["passes_s"] = sum(passes) if None not in passes else None
    sample["overhead_s"] = (
        merge["wall_s"] - sample["passes_s"] if sample["passes_s"] is not None else None
    )
    sample["ratio_wall"] = merge["wall_s"] / floor["floor_s"]
    sample["ratio_passes"] = (
        sample["passes_s"] / floor["floor_s"] if sample["passes_s"] is not None else None
    )
    return sample


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

ROWS = [
    ("I/O floor (2 reads + 1 write)", "floor_s", "s"),
    ("  floor: one read of all inputs", "floor_read_pass_s", "s"),
    ("  floor: write of output", "floor_write_s", "s"),
    ("merge wall (subprocess)", "merge_wall_s", "s"),
    ("ratio merge wall / floor", "ratio_wall", "x"),
    ("reduce pass wall", "reduce_s", "s"),
    ("map pass wall", "map_s", "s"),
    ("ratio (reduce+map) / floor", "ratio_passes", "x"),
    ("startup/plan/shutdown (wall - passes)", "overhead_s", "s"),
    ("driver peak RSS", "driver_peak_rss_bytes", "B"),
    ("largest worker peak RSS", "worker_peak_rss_bytes", "B"),
    ("CLI process max RSS (wait4)", "cli_maxrss_bytes", "B"),
    ("reduce bytes read", "reduce_bytes_read", "B"),
    ("map bytes read", "map_bytes_read", "B"),
    ("map bytes written", "map_bytes_written", "B"),
    ("output safetensors bytes", "out_bytes", "B"),
]


def median_of(values: Sequence[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value / 2**20:,.0f} MiB"


def print_table(samples: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    width = max(len(label) for label, _, _ in ROWS)
    runs = "  ".join(f"{'run ' + str(k + 1):>12}" for k in range(len(samples)))
    print(f"\n{'metric':<{width}}  {'median':>12}  {'min':>12}  {runs}")
    print("-" * (width + 30 + 14 * len(samples)))
    for label, key, unit in ROWS:
        present = [s[key] for s in samples if s.get(key) is not None]
        low = min(present) if present else None
        cells = "  ".join(f"{fmt(s.get(key), unit):>12}" for s in samples)
        print(f"{label:<{width}}  {fmt(summary[key], unit):>12}  {fmt(low, unit):>12}  {cells}")


def print_task_stats(report: dict[str, Any]) -> None:
    """Sanity line: the statistics the merge found against the generated densities."""
    tasks = report.get("tasks")
    if not isinstance(tasks, list):
        return
    lambdas = report.get("lambda_applied")
    print("\nmerge statistics (last run) vs generated mask density:")
    for k, task in enumerate(tasks):
        expected = AGENT_DENSITIES[k] if k < len(AGENT_DENSITIES) else "n/a"
        density, rho = task.get("density", "n/a"), task.get("rho", "n/a")
        lam = lambdas[k] if isinstance(lambdas, list) and k < len(lambdas) else "n/a"
        print(
            f"  task {k + 1}: generated density {expected}; reported density {density}, "
            f"rho {rho}, lambda applied {lam}"
        )


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=0.5e9, help="parameters per model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mb", type=int, default=256)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--method", default="ram_plus")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the last merge output")
    p.add_argument("--generate-only", action="store_true", help="generate inputs and stop")
    p.add_argument("--floor-only", action="store_true", help="skip the merge runs")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument(
        "--merge-arg", action="append", default=[], help="extra argument for ram-dist merge"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir: Path = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    layout = ensure_models(workdir, args.params, args.shard_mb * 10**6, args.seed)
    gen_s = time.perf_counter() - start
    if args.generate_only:
        return 0
    models_dir = workdir / "models"
    inputs = [p for name in model_names() for p in safetensors_files(models_dir / name)]
    base_bytes = sum(p.stat().st_size for p in safetensors_files(models_dir / "base"))
    input_bytes = sum(p.stat().st_size for p in inputs)

    print(f"warming page cache: reading {input_bytes / 2**30:.2f} GiB of inputs", flush=True)
    read_files(inputs, bytearray(READ_BLOCK))

    cmd, env = cli_command()
    if args.cli:
        cmd = shlex.split(args.cli)
    out = workdir / "out"
    full_cmd = cmd + merge_argv(args, models_dir, out)
    samples: list[dict[str, Any]] = []
    last_report: dict[str, Any] = {}
    for r in range(args.repeats):
        floor = measure_floor(inputs, base_bytes, workdir / "floor_out.bin")
        print(f"repeat {r + 1}/{args.repeats}: floor {floor['floor_s']:.2f} s", flush=True)
        if args.floor_only:
            samples.append(dict(floor))
            continue
        merge = run_merge(full_cmd, env, out, workdir / f"merge_{r + 1}.log")
        print(f"repeat {r + 1}/{args.repeats}: merge {merge['wall_s']:.2f} s", flush=True)
        samples.append(sample_from(floor, merge))
        last_report = merge["report"]
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)

    summary = {key: median_of([s.get(key) for s in samples]) for _, key, _ in ROWS}
    print(
        f"\nmodel: {layout.params / 1e9:.3f} B params x 4 checkpoints, "
        f"{input_bytes / 2**30:.2f} GiB read per pass, base {base_bytes / 2**30:.2f} GiB, "
        f"{len(layout.shards)} shard(s) each; {args.repeats} repeat(s), medians"
    )
    print("command: " + " ".join(full_cmd))
    print_table(samples, summary)
    print_task_stats(last_report)
    if args.json:
        result = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": {
                "params": layout.params,
                "hidden": layout.hidden,
                "layers": layout.layers,
                "vocab": layout.vocab,
                "shards": len(layout.shards),
                "input_bytes": input_bytes,
                "base_bytes": base_bytes,
            },
            "generation_s": gen_s,
            "command": full_cmd,
            "median": summary,
            "samples": samples,
            "last_report": last_report,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
