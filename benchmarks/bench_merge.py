"""End-to-end benchmark of ``ram-dist merge`` and mergekit against a plain-I/O floor.

What it does, in one run:

1. Generates (once; cached in ``--workdir`` and reused when the parameters match) a synthetic
   bf16 Llama-like base checkpoint and three "RL agents" fine-tuned from it. Each agent has a
   sparse task vector with an independent, seeded Bernoulli mask (densities about 3 %, 46 %
   and 54 %, as reported for RL-trained agents) and changes large enough to survive bf16
   rounding and the merge's ``eps = 1e-5`` threshold. Generation works tensor by tensor and
   holds at most one output shard in memory.
2. Warms the page cache by reading every input once, then measures every configuration of
   ``--runs``, ``--repeats`` times, in an order that rotates by one each repeat:

   * ``floor``: read every input byte twice (the merge has a reduce pass and a map pass,
     each reading all inputs), with plain buffered 16 MiB reads, and write as many bytes as
     the base's safetensors files once (no fsync, like the merge);
   * ``ramdist:METHOD``: ``ram-dist merge`` as a subprocess, wall time and max RSS (wait4)
     measured from outside, ``OUT/merge_report.json`` read for pass times, bytes, memory;
   * ``mergekit:METHOD``: ``mergekit-yaml`` on the same inputs with matching parameters, run
     in-process by ``mergekit_wrapper.py`` (which records ``/proc/self/io`` and the tensor
     bytes mergekit loaded), wall time and max RSS from wait4.

   Every output is checked to hold every tensor of the model.
3. Prints medians (one column per configuration), every sample, and ``--json FILE`` writes it
   all. ``--memory-sizes`` also runs ram-dist ``ram_plus`` once per model size and compares
   the largest worker's peak RSS across sizes.

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
import yaml
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


# --------------------------------------------------------------------------------------------
# Configurations and their commands
# --------------------------------------------------------------------------------------------

RAMDIST_METHODS = ("ram_plus", "ram", "ties", "ram_plus_soft", "ramplus_tl")
MERGEKIT_METHODS = ("ram", "ramplus_tl", "ties")
DEFAULT_RUNS = (
    "floor,ramdist:ram_plus,ramdist:ram,ramdist:ties,mergekit:ram,mergekit:ramplus_tl,mergekit:ties"
)
WRAPPER = Path(__file__).resolve().parent / "mergekit_wrapper.py"


@dataclass(frozen=True)
class Run:
    """One configuration to measure: ``floor``, ``ramdist:METHOD`` or ``mergekit:METHOD``."""

    tool: str
    method: str = ""

    @property
    def name(self) -> str:
        return f"{self.tool}:{self.method}" if self.method else self.tool

    @property
    def slug(self) -> str:
        """The name as a file name part."""
        return self.name.replace(":", "-")


def parse_runs(text: str) -> list[Run]:
    """``floor,ramdist:ram,...`` as Runs; ``none`` (or nothing) for no comparison at all."""
    allowed = {
        "floor": ("",),
        "ramdist": RAMDIST_METHODS,
        "previous": RAMDIST_METHODS,
        "mergekit": MERGEKIT_METHODS,
    }
    runs: list[Run] = []
    for item in (s.strip() for s in text.split(",")):
        if item in ("", "none"):
            continue
        tool, _, method = item.partition(":")
        if tool not in allowed or method not in allowed[tool]:
            raise SystemExit(
                f"--runs: unknown configuration {item!r}; valid: floor, "
                f"ramdist:{{{','.join(RAMDIST_METHODS)}}} (previous:... with --previous-cli), "
                f"mergekit:{{{','.join(MERGEKIT_METHODS)}}}"
            )
        if Run(tool, method) in runs:
            raise SystemExit(f"--runs lists {item} twice")
        runs.append(Run(tool, method))
    return runs


@dataclass(frozen=True)
class MethodParams:
    """Merge parameters given to both tools, so that their runs compute the same thing."""

    r: float
    alpha: float
    eps: float
    density: float
    weight: float


def ramdist_method_args(method: str, p: MethodParams) -> list[str]:
    """``ram-dist merge`` flags for ``method``: every parameter explicit, none left to defaults."""
    if method == "ties":
        density, weight = repr(p.density), repr(p.weight)
        return ["--density", density, "--weight", weight, "--lambda", "1.0", "--normalize"]
    args = ["--eps", repr(p.eps)]
    if method != "ram":
        args += ["--r", repr(p.r), "--alpha", repr(p.alpha)]
    return args


def mergekit_config(method: str, p: MethodParams, models_dir: Path) -> dict[str, Any]:
    """mergekit's YAML for ``method``, matching ``ramdist_method_args``.

    ``dtype: float32`` because ram-dist computes in float32 (mergekit would otherwise compute
    in the inputs' bf16), ``out_dtype: bfloat16`` so that both write the base's dtype.
    """
    tasks = [str(models_dir / name) for name in model_names()[1:]]
    if method == "ties":
        models = [
            {"model": t, "parameters": {"weight": p.weight, "density": p.density}} for t in tasks
        ]
        params: dict[str, Any] = {"normalize": True, "lambda": 1.0}
    else:
        models = [{"model": t} for t in tasks]
        params = {"epsilon": p.eps}
        if method != "ram":
            params |= {"r": p.r, "alpha": p.alpha}
    return {
        "merge_method": method,
        "base_model": str(models_dir / "base"),
        "models": models,
        "parameters": params,
        "dtype": "float32",
        "out_dtype": "bfloat16",
    }


def mergekit_options(args: argparse.Namespace) -> list[str]:
    """The ``mergekit-yaml`` options of a fast CPU merge (see the README for why each)."""
    base = ["--lazy-unpickle", "--no-copy-tokenizer", "--out-shard-size", f"{args.shard_mb}M"]
    return base + ["--quiet"] + list(args.mergekit_arg)


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


def cpu_count() -> int:
    """CPUs this process may use: what a local Ray offers as workers by default."""
    return len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------------------------
# Running one configuration
# --------------------------------------------------------------------------------------------


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


@dataclass
class Bench:
    """One set of generated inputs and how to run every configuration on them."""

    args: argparse.Namespace
    workdir: Path
    layout: Layout
    params: MethodParams
    ramdist_cli: list[str]
    env: dict[str, str]

    @property
    def models_dir(self) -> Path:
        return self.workdir / "models"

    @property
    def inputs(self) -> list[Path]:
        return [p for name in model_names() for p in safetensors_files(self.models_dir / name)]

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
            if self.args.chunk_mb is not None:
                argv += ["--chunk-mb", str(self.args.chunk_mb)]
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
        sample |= check_output(out, len(self.layout.tensors))
        if not self.args.keep:
            shutil.rmtree(out, ignore_errors=True)
        return sample, report


def rotated(runs: Sequence[Run], k: int) -> list[Run]:
    """``runs`` started at position ``k``: each repeat starts with the next configuration."""
    k %= max(1, len(runs))
    return list(runs[k:]) + list(runs[:k])


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Ratios to the floor measured in the same repeat (none if the floor was not run)."""
    floor = results.get("floor")
    for name, sample in results.items():
        if name == "floor" or floor is None:
            continue
        sample["ratio_wall"] = sample["wall_s"] / floor["wall_s"]
        passes = sample.get("passes_s")
        sample["ratio_passes"] = None if passes is None else passes / floor["wall_s"]


def measure_all(
    bench: Bench, runs: Sequence[Run], repeats: int
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """``repeats`` rounds over ``runs`` in rotating order; samples and last report per run."""
    samples: dict[str, list[dict[str, Any]]] = {run.name: [] for run in runs}
    reports: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        results: dict[str, dict[str, Any]] = {}
        for run in rotated(runs, r):
            results[run.name], report = bench.measure(run, r + 1)
            if report:
                reports[run.name] = report
            wall = results[run.name]["wall_s"]
            print(f"repeat {r + 1}/{repeats}: {run.name} {wall:.2f} s", flush=True)
        add_ratios(results)
        for run in runs:
            samples[run.name].append(results[run.name])
    return samples, reports


# --------------------------------------------------------------------------------------------
# Memory scaling
# --------------------------------------------------------------------------------------------


def memory_scaling(
    args: argparse.Namespace, sizes: Sequence[float], params: MethodParams
) -> list[dict[str, Any]]:
    """ram-dist ``ram_plus`` once per model size, each in ``WORKDIR/mem-SIZE``."""
    rows: list[dict[str, Any]] = []
    run = Run("ramdist", "ram_plus")
    args = argparse.Namespace(**(vars(args) | {"chunk_mb": args.memory_chunk_mb}))
    cli, env = ramdist_cli(args)
    for size in sizes:
        sub = args.workdir / f"mem-{size / 1e9:g}B"
        layout = ensure_models(sub, size, args.shard_mb * 10**6, args.seed)
        bench = Bench(args, sub, layout, params, cli, env)
        read_files(bench.inputs, bytearray(READ_BLOCK))
        sample, _ = bench.measure(run, 1)
        print(f"memory scaling: {size:g} params, {sample['wall_s']:.2f} s", flush=True)
        keys = (
            "wall_s", "units", "worker_peak_rss_bytes", "driver_peak_rss_bytes", "bytes_read",
            "worker_peak_private_bytes", "driver_peak_private_bytes",
        )  # fmt: skip
        row = {"size": size, "params": layout.params, "input_bytes": bench.input_bytes}
        rows.append(row | {k: sample.get(k) for k in keys} | {"command": bench.command(run)})
    return rows


def print_memory_scaling(rows: list[dict[str, Any]], chunk_mb: int) -> None:
    """Per size: worker and driver peaks, as RSS (with the pages of Ray's object store that
    the process touched) and private (without them), and the spread of the worker peaks."""
    print(f"\nmemory scaling: ram-dist ram_plus, --chunk-mb {chunk_mb}, one run per size")
    print(
        f"{'params':>14}  {'inputs':>10}  {'units':>6}  {'worker RSS':>11}  "
        f"{'worker private':>14}  {'driver RSS':>11}  {'driver private':>14}"
    )
    for row in rows:
        print(
            f"{row['params']:>14,}  {fmt(row['input_bytes'], 'B'):>10}  "
            f"{fmt(row['units'], 'n'):>6}  {fmt(row['worker_peak_rss_bytes'], 'B'):>11}  "
            f"{fmt(row.get('worker_peak_private_bytes'), 'B'):>14}  "
            f"{fmt(row['driver_peak_rss_bytes'], 'B'):>11}  "
            f"{fmt(row.get('driver_peak_private_bytes'), 'B'):>14}"
        )
    for key, label in (
        ("worker_peak_private_bytes", "worker peak private"),
        ("worker_peak_rss_bytes", "worker peak RSS"),
    ):
        peaks = [r[key] for r in rows if r.get(key)]
        if len(peaks) >= 2:
            spread = max(peaks) / min(peaks)
            verdict = "within" if spread <= 1.2 else "NOT within"
            print(f"largest / smallest {label}: {spread:.2f}x ({verdict} the 20 % target)")


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------

ROWS = [
    ("wall time", "wall_s", "s"),
    ("ratio wall / floor (same repeat)", "ratio_wall", "x"),
    ("  floor: one read of all inputs", "floor_read_pass_s", "s"),
    ("  floor: write of output", "floor_write_s", "s"),
    ("reduce pass wall", "reduce_s", "s"),
    ("map pass wall", "map_s", "s"),
    ("ratio (reduce+map) / floor", "ratio_passes", "x"),
    ("startup/plan/shutdown (wall - passes)", "overhead_s", "s"),
    ("work units (map pass)", "units", "n"),
    ("driver peak RSS (report)", "driver_peak_rss_bytes", "B"),
    ("largest worker peak RSS (report)", "worker_peak_rss_bytes", "B"),
    ("driver peak private (no object store)", "driver_peak_private_bytes", "B"),
    ("largest worker peak private", "worker_peak_private_bytes", "B"),
    ("process max RSS (wait4)", "proc_maxrss_bytes", "B"),
    ("largest single process peak RSS", "largest_process_rss_bytes", "B"),
    ("bytes read (tensor data)", "bytes_read", "B"),
    ("  reduce pass bytes read", "reduce_bytes_read", "B"),
    ("  map pass bytes read", "map_bytes_read", "B"),
    ("rchar, whole process", "rchar_bytes", "B"),
    ("rchar, merge only (after imports)", "rchar_merge_bytes", "B"),
    ("output safetensors bytes", "out_bytes", "B"),
    ("output tensors", "out_tensors", "n"),
]
SAMPLE_ROWS = [
    ("wall", "wall_s", "s"),
    ("wall / floor", "ratio_wall", "x"),
    ("reduce+map", "passes_s", "s"),
    ("(reduce+map) / floor", "ratio_passes", "x"),
]


def median_of(values: Sequence[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = dict.fromkeys(k for s in samples for k in s)
    return {k: median_of([s.get(k) for s in samples]) for k in keys}


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.2f} s"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "n":
        return f"{value:,.0f}"
    return f"{value / 2**20:,.0f} MiB"


def print_medians(summary: dict[str, dict[str, Any]]) -> None:
    """Medians, one column per configuration; rows that no configuration has are left out."""
    names = list(summary)
    width = max(len(label) for label, _, _ in ROWS)
    cols = [max(12, len(n)) for n in names]
    print(
        "\nmedians"
        + " " * (width - 5)
        + "".join(f"  {n:>{w}}" for n, w in zip(names, cols, strict=True))
    )
    print("-" * (width + sum(c + 2 for c in cols)))
    for label, key, unit in ROWS:
        values = [summary[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        cells = "".join(f"  {fmt(v, unit):>{w}}" for v, w in zip(values, cols, strict=True))
        print(f"{label:<{width}}{cells}")


def print_samples(samples: dict[str, list[dict[str, Any]]]) -> None:
    """Every sample of the timing rows, with its median and minimum."""
    repeats = max(len(s) for s in samples.values())
    width = max(len(n) for n in samples) + 2 + max(len(label) for label, _, _ in SAMPLE_ROWS)
    runs = "".join(f"  {'run ' + str(k + 1):>10}" for k in range(repeats))
    print(f"\n{'samples':<{width}}  {'median':>10}  {'min':>10}{runs}")
    print("-" * (width + 24 + 12 * repeats))
    for name, rows in samples.items():
        for label, key, unit in SAMPLE_ROWS:
            values = [s.get(key) for s in rows]
            present = [v for v in values if v is not None]
            if not present:
                continue
            cells = "".join(f"  {fmt(v, unit):>10}" for v in values)
            line = f"{name + '  ' + label:<{width}}  {fmt(median_of(values), unit):>10}"
            print(f"{line}  {fmt(min(present), unit):>10}{cells}")


def print_task_stats(report: dict[str, Any]) -> None:
    """Sanity line: the statistics the merge found against the generated densities."""
    tasks = report.get("tasks")
    if not isinstance(tasks, list):
        return
    lambdas = report.get("lambda_applied")
    print("\nram-dist ram_plus statistics (last run) vs generated mask density:")
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


def parse_sizes(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=0.5e9, help="parameters per model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default=DEFAULT_RUNS, help="configurations to measure, or none")
    p.add_argument(
        "--chunk-mb", type=int, default=None, help="ram-dist --chunk-mb (default: its own)"
    )
    p.add_argument(
        "--memory-chunk-mb", type=int, default=64, help="--chunk-mb of the memory-scaling runs"
    )
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--r", type=float, default=0.1, help="RAM+ r (ram-dist and mergekit)")
    p.add_argument("--alpha", type=float, default=2.0, help="RAM+ alpha (both tools)")
    p.add_argument("--eps", type=float, default=1e-5, help="RAM epsilon (both tools)")
    p.add_argument("--ties-density", type=float, default=0.5, help="TIES density (both)")
    p.add_argument("--ties-weight", type=float, default=1.0, help="TIES weight (both)")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="keep the merge outputs in WORKDIR/out")
    p.add_argument("--generate-only", action="store_true", help="generate inputs and stop")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument(
        "--previous-cli",
        default=None,
        help="another ram-dist (e.g. an older checkout: 'env PYTHONPATH=/tmp/old python -m "
        "ram_dist.cli'), measured as previous:METHOD in the same alternating run",
    )
    p.add_argument(
        "--merge-arg", action="append", default=[], help="extra argument for ram-dist merge"
    )
    p.add_argument(
        "--mergekit-arg", action="append", default=[], help="extra argument for mergekit-yaml"
    )
    p.add_argument(
        "--memory-sizes",
        type=parse_sizes,
        default=[],
        help="also run ram-dist ram_plus once per size (e.g. 0.1e9,1e9) for memory scaling",
    )
    return p.parse_args(argv)


def ramdist_cli(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    cmd, env = cli_command()
    return (shlex.split(args.cli) if args.cli else cmd), env


def method_params(args: argparse.Namespace) -> MethodParams:
    return MethodParams(args.r, args.alpha, args.eps, args.ties_density, args.ties_weight)


def model_info(bench: Bench) -> dict[str, Any]:
    lay = bench.layout
    return {
        "params": lay.params,
        "hidden": lay.hidden,
        "layers": lay.layers,
        "vocab": lay.vocab,
        "tensors": len(lay.tensors),
        "shards": len(lay.shards),
        "input_bytes": bench.input_bytes,
        "base_bytes": bench.base_bytes,
    }


def compare(args: argparse.Namespace, runs: list[Run], result: dict[str, Any]) -> None:
    """Generate (or reuse) the inputs, measure ``runs``, print and record the results."""
    start = time.perf_counter()
    layout = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    result["generation_s"] = time.perf_counter() - start
    if args.generate_only:
        return
    cli, env = ramdist_cli(args)
    bench = Bench(args, args.workdir, layout, method_params(args), cli, env)
    bench.write_mergekit_configs(runs)
    print(f"warming page cache: reading {bench.input_bytes / 2**30:.2f} GiB", flush=True)
    read_files(bench.inputs, bytearray(READ_BLOCK))
    samples, reports = measure_all(bench, runs, args.repeats)
    summary = {name: medians(rows) for name, rows in samples.items()}

    info = model_info(bench)
    print(
        f"\nmodel: {info['params'] / 1e9:.3f} B params x 4 checkpoints, "
        f"{info['input_bytes'] / 2**30:.2f} GiB read per pass, base "
        f"{info['base_bytes'] / 2**30:.2f} GiB, {info['shards']} shard(s) each; "
        f"{args.repeats} repeat(s), {cpu_count()} CPUs"
    )
    commands = {run.name: bench.user_command(run) for run in runs}
    for name, command in commands.items():
        print(f"  {name}: {command}")
    print_medians(summary)
    print_samples(samples)
    print_task_stats(reports.get("ramdist:ram_plus", {}))
    result |= {
        "model": info,
        "runs": [run.name for run in runs],
        "commands": commands,
        "argv": {run.name: bench.command(run) for run in runs},
        "mergekit_options": mergekit_options(args),
        "median": summary,
        "samples": samples,
        "last_reports": reports,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs = parse_runs(args.runs)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result: dict[str, Any] = {"config": config, "cpus": cpu_count()}
    result["method_params"] = vars(method_params(args))
    if runs or args.generate_only:
        compare(args, runs, result)
    if args.memory_sizes and not args.generate_only:
        rows = memory_scaling(args, args.memory_sizes, method_params(args))
        print_memory_scaling(rows, args.memory_chunk_mb)
        result["memory_scaling"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
