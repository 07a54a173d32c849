"""PEFT LoRA adapters as merge tasks: the passes against the I/O floor and against the same
merge with the three agents as full checkpoints, per rank, in one run (issue 33).

Inputs, in ``--workdir`` (generated once, reused while the parameters match):

* ``models/base``: the bf16 Llama base of ``benchmarks.inputs`` (``--params`` parameters);
* ``r{R}/adapter{1,2,3}``: per rank R of ``--rank``, three PEFT LoRA adapters of the base,
  written directly with safetensors in PEFT's format (keys
  ``base_model.model.<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], float32
  by default, ``--adapter-dtype bf16`` for bf16; an ``adapter_config.json`` with the keys
  PEFT writes), targeting every ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
  down_proj``, with non-zero random ``lora_B`` (``lora_alpha = 2 r``, scale 2; A and B
  drawn so that the delta has a standard deviation of about 1e-3, 5 % of the base's);
* ``r{R}/full{1,2,3}``: the same agents as full checkpoints, the base with the adapter merged
  (``bf16(float32(W) + s * (B @ A))`` per tensor, in torch: a matrix multiply, not the
  spec's fixed order, so not bit-exact to ram-dist's values; they are only for timing).

Then, ``--repeats`` times, per rank, in an order that rotates by one each repeat, the
configurations of ``--runs``:

* ``floor``: read the base and the three adapters twice and write the base's bytes once
  (``running.measure_floor``, as ``bench_merge`` measures its floor);
* ``adapters``: ``ram-dist merge --method ram_plus`` with the base and the three adapters;
* ``full``: the same with the three full checkpoints;
* ``mergekit`` (not by default): ``mergekit-yaml`` with ``merge_method: ram`` and
  ``model: BASE+ADAPTER`` for each agent (mergekit merges each adapter into a full copy of
  the base with PEFT first, in its ``--lora-merge-cache``, fresh for every run), in-process
  under ``benchmarks/mergekit_wrapper.py``; wall time and peak RSS from wait4.

Before each rank's measurements its inputs are read once (page cache). It prints the passes'
wall time (``merge_report.json``), wall times, the ratios adapters / floor (target: at most
1.5) and adapters / full (target: at most 0.5), a linear fit of the adapters' passes over
the rank (where the rank-r products overtake the I/O), and, with ``mergekit``, mergekit's
wall time and peak memory against ram-dist's (target: 10x faster, a tenth of the memory).

Example::

    python -m benchmarks.bench_lora --params 1e9 --rank 1,16,64 --repeats 1 \\
        --workdir /tmp/ramdist-lora --merge-arg=--address --merge-arg=local

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.commands import WRAPPER, MethodParams, cli_command, ramdist_method_args
from benchmarks.inputs import GENERATOR_VERSION, plan_models, safetensors_files, write_model
from benchmarks.running import (
    READ_BLOCK,
    check_output,
    cpu_count,
    measure_floor,
    mergekit_figures,
    ramdist_figures,
    read_files,
    rotated,
    run_process,
)
from ram_dist.synthetic.files import write_shards
from ram_dist.synthetic.llama import LlamaDims
from ram_dist.synthetic.weights import name_seed

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AGENTS = 3
RUNS = ("floor", "adapters", "full", "mergekit")
DEFAULT_RUNS = "floor,adapters,full"
#: Bumped whenever the same parameters would give other adapter files.
ADAPTER_VERSION = 1
#: Standard deviation of the delta `s * B @ A` (the base's weights have 0.02).
DELTA_STD = 1e-3
#: The key set PEFT 0.21.2 writes in `adapter_config.json` for a plain LoRA.
PEFT_CONFIG: dict[str, Any] = {
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "kasa_config": None,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": None,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "lora_ga_config": None,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "monteclora_config": None,
    "peft_type": "LORA",
    "peft_version": "0.21.2",
    "qalora_group_size": 16,
    "r": None,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_bdlora": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
    "velora_config": None,
}


def parse_ranks(text: str) -> list[int]:
    ranks = [int(s) for s in text.split(",") if s.strip()]
    if not ranks or min(ranks) < 1:
        raise SystemExit(f"--rank: positive integers, comma separated (got {text!r})")
    return ranks


def parse_runs(text: str) -> list[str]:
    runs = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or len(set(runs)) != len(runs):
        raise SystemExit(f"--runs: each of {', '.join(RUNS)} at most once (got {text!r})")
    return runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=1e9, help="parameters of the base (1e9)")
    p.add_argument("--rank", type=parse_ranks, default=[1, 16, 64], help="ranks (1,16,64)")
    p.add_argument("--runs", type=parse_runs, default=parse_runs(DEFAULT_RUNS),
                   help=f"configurations, of {','.join(RUNS)} ({DEFAULT_RUNS})")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-lora"))
    p.add_argument("--adapter-dtype", choices=("float32", "bf16"), default="float32")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of checkpoints")
    p.add_argument("--unit-mb", type=int, default=None, help="ram-dist --unit-mb")
    p.add_argument("--workers", type=int, default=None, help="ram-dist --workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-arg", action="append", default=[], help="for every ram-dist merge")
    p.add_argument("--mergekit-arg", action="append", default=[], help="for mergekit-yaml")
    p.add_argument("--cli", default=None, help="command to run instead of ram-dist")
    p.add_argument("--json", type=Path, default=None, help="also write everything here")
    p.add_argument("--no-kernel", dest="kernel", action="store_false",
                   help="leave out the LoRA kernel's rate per rank (one core, no I/O)")  # fmt: skip
    p.add_argument("--generate-only", action="store_true", help="generate the inputs and stop")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _stamped(folder: Path, key: dict[str, Any]) -> bool:
    stamp = folder / "done.json"
    return stamp.is_file() and json.loads(stamp.read_text()) == key


def _stamp(folder: Path, key: dict[str, Any]) -> None:
    (folder / "done.json").write_text(json.dumps(key, indent=2) + "\n")


def ensure_base(workdir: Path, params: float, shard_bytes: int, seed: int) -> tuple[Path, Any]:
    """`benchmarks.inputs`' base (no agents) in `WORKDIR/models/base`; its dims and shards."""
    dims, shards = plan_models(params, shard_bytes)
    folder = workdir / "models" / "base"
    key = {"generator_version": GENERATOR_VERSION, "params": params,
           "shard_bytes": shard_bytes, "seed": seed}  # fmt: skip
    if not _stamped(folder, key):
        shutil.rmtree(folder, ignore_errors=True)
        start = time.perf_counter()
        print(f"generating the base: {dims.params / 1e9:.3f} B params (hidden {dims.hidden}, "
              f"{dims.layers} layers, {len(shards)} shard(s)) in {folder}", flush=True)  # fmt: skip
        write_model(folder, dims, shards, seed, None)
        _stamp(folder, key)
        print(f"  base: {time.perf_counter() - start:.1f} s", flush=True)
    return folder, (dims, shards)


def targeted(dims: LlamaDims) -> list[tuple[str, tuple[int, ...]]]:
    """`(module, (out, in))` of every linear layer the adapters target."""
    return [
        (name.removesuffix(".weight"), shape)
        for name, shape in dims.tensors()
        if name.endswith(".weight") and name.split(".")[-2] in TARGETS
    ]


def factors(module: str, shape: tuple[int, ...], rank: int, agent: int, seed: int):
    """Agent `agent`'s A [r, in] and B [out, r] of `module`, float32: `A = c N / sqrt(r)`,
    `B = c N` with `c^2 = DELTA_STD / scale`, so that `scale * B @ A` has about `DELTA_STD`."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(name_seed(seed, f"adapter{agent}.r{rank}.{module}"))
    c = (DELTA_STD / 2.0) ** 0.5  # lora_alpha = 2 r: scale 2
    a = torch.randn((rank, in_f), generator=g).mul_(c / rank**0.5)
    b = torch.randn((out_f, rank), generator=g).mul_(c)
    return a, b


def write_adapter(folder: Path, base: Path, dims: LlamaDims, rank: int, agent: int,
                  seed: int, dtype: torch.dtype) -> None:  # fmt: skip
    """One PEFT LoRA adapter folder, as `PeftModel.save_pretrained` writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for module, shape in targeted(dims):
        a, b = factors(module, shape, rank, agent, seed)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = PEFT_CONFIG | {
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(TARGETS),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def write_full(folder: Path, base: Path, adapter: Path, shards: list[list[str]]) -> None:
    """The base with `adapter` merged in, per tensor: `bf16(W + s * B @ A)` (a matmul)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    handles = {}
    for path in safetensors_files(base):
        handles[path] = safe_open(str(path), "pt")
    where = {name: h for h in handles.values() for name in h.keys()}  # noqa: SIM118
    lora = safe_open(str(adapter / "adapter_model.safetensors"), "pt")
    keys = set(lora.keys())  # noqa: SIM118

    def tensor(name: str) -> torch.Tensor:
        w = where[name].get_tensor(name)
        a_key = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
        if a_key not in keys:
            return w
        a = lora.get_tensor(a_key).float()
        b = lora.get_tensor(a_key.replace("lora_A", "lora_B")).float()
        return (w.float() + scale * (b @ a)).to(w.dtype)

    write_shards(folder, shards, tensor, single_file=len(shards) == 1)
    for extra in ("config.json", "generation_config.json"):
        if (base / extra).is_file():
            shutil.copy2(base / extra, folder / extra)


def ensure_rank(workdir: Path, base: Path, layout: Any, rank: int, args: argparse.Namespace,
                full: bool) -> Path:  # fmt: skip
    """The adapters (and, if `full`, full checkpoints) of `rank` in `WORKDIR/r{rank}`."""
    dims, shards = layout
    folder = workdir / f"r{rank}"
    key = {"version": ADAPTER_VERSION, "base": json.loads((base / "done.json").read_text()),
           "rank": rank, "dtype": args.adapter_dtype, "full": full}  # fmt: skip
    if _stamped(folder, key) or (not full and _stamped(folder, key | {"full": True})):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    dtype = torch.float32 if args.adapter_dtype == "float32" else torch.bfloat16
    for k in range(1, AGENTS + 1):
        start = time.perf_counter()
        write_adapter(folder / f"adapter{k}", base, dims, rank, k, args.seed, dtype)
        made = f"adapter{k}"
        if full:
            write_full(folder / f"full{k}", base, folder / f"adapter{k}", shards)
            made += f" and full{k}"
        print(f"  rank {rank}: {made} {time.perf_counter() - start:.1f} s", flush=True)
    _stamp(folder, key)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


class Bench:
    """The runs of one rank on its inputs (`dir`: the rank's folder)."""

    def __init__(self, args: argparse.Namespace, base: Path, folder: Path, tensors: int) -> None:
        self.args, self.base, self.dir, self.tensors = args, base, folder, tensors
        self.cli, self.env = cli_command(args.cli)
        #: ram-dist's defaults (bench_merge's): r 0.1, alpha 2.0, eps 1e-5
        self.params = MethodParams(0.1, 2.0, 1e-5, 0.5, 1.0)

    def tasks(self, kind: str) -> list[Path]:
        return [self.dir / f"{kind}{k}" for k in range(1, AGENTS + 1)]

    def inputs(self, run: str) -> list[Path]:
        kinds = {"floor": "adapter", "adapters": "adapter", "mergekit": "adapter", "full": "full"}
        folders = [self.base, *self.tasks(kinds[run])]
        return [p for f in folders for p in sorted(f.glob("*.safetensors"))]

    def command(self, run: str, out: Path, repeat: int) -> list[str]:
        if run == "mergekit":
            stats = self.dir / f"mergekit_{repeat}.io.json"
            opts = [
                "--lazy-unpickle", "--no-copy-tokenizer",
                "--out-shard-size", f"{self.args.shard_mb}M",
                "--lora-merge-cache", str(self.lora_cache), "--lora-merge-dtype", "bfloat16",
                "--quiet", *self.args.mergekit_arg,
            ]  # fmt: skip
            mk = [str(self.yaml), str(out), *opts]
            return [sys.executable, str(WRAPPER), str(stats), "--", *mk]
        argv = ["merge", "--base", str(self.base)]
        for task in self.tasks("adapter" if run == "adapters" else "full"):
            argv += ["--task", str(task)]
        argv += ["--out", str(out), "--method", "ram_plus"]
        if self.args.unit_mb is not None:
            argv += ["--unit-mb", str(self.args.unit_mb)]
        if self.args.workers is not None:
            argv += ["--workers", str(self.args.workers)]
        return self.cli + argv + ramdist_method_args("ram_plus", self.params) + self.args.merge_arg

    @property
    def yaml(self) -> Path:
        return self.dir / "mergekit_ram.yaml"

    @property
    def lora_cache(self) -> Path:
        return self.dir / "mergekit-lora-cache"

    def write_yaml(self) -> None:
        """mergekit's `ram` with `model: BASE+ADAPTER` per agent, the parameters of
        `ramdist_method_args('ram_plus')` that `ram` has (bench_merge's `mergekit_config`)."""
        config = {
            "merge_method": "ram",
            "base_model": str(self.base),
            "models": [{"model": f"{self.base}+{a}"} for a in self.tasks("adapter")],
            "parameters": {"epsilon": self.params.eps},
            "dtype": "float32",
            "out_dtype": "bfloat16",
        }
        self.yaml.write_text(yaml.safe_dump(config, sort_keys=False))

    def measure(self, run: str, repeat: int) -> dict[str, Any]:
        if run == "floor":
            return measure_floor(self.inputs(run), folder_bytes(self.base), self.dir / "floor.bin")
        out = self.dir / f"out-{run}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(self.lora_cache, ignore_errors=True)
        cmd = self.command(run, out, repeat)
        wall, usage = run_process(cmd, self.env, self.dir / f"{run}_{repeat}.log")
        maxrss = usage.ru_maxrss * 1024
        if run == "mergekit":
            sample = mergekit_figures(json.loads(Path(cmd[2]).read_text()), wall, maxrss)
            sample["cpu_s"] = usage.ru_utime + usage.ru_stime
        else:
            report = json.loads((out / "merge_report.json").read_text())
            sample = ramdist_figures(report, wall, maxrss, self.args.workers or cpu_count())
        sample |= check_output(out, self.tensors)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(self.lora_cache, ignore_errors=True)
        return sample


def measure_all(benches: dict[int, Bench], runs: list[str], repeats: int) -> dict:
    """`repeats` rounds; in each, per rank, its inputs read once, then `runs` rotated."""
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {
        rank: {run: [] for run in runs} for rank in benches
    }
    for r in range(repeats):
        for rank, bench in benches.items():
            read_files(sorted({p for run in runs for p in bench.inputs(run)}),
                       bytearray(READ_BLOCK))  # fmt: skip
            for run in rotated(runs, r):
                sample = bench.measure(run, r + 1)
                samples[rank][run].append(sample)
                passes = sample.get("passes_s")
                more = f", passes {passes:.2f} s" if passes is not None else ""
                print(f"repeat {r + 1}/{repeats}, rank {rank}: {run} wall "
                      f"{sample['wall_s']:.2f} s{more}", flush=True)  # fmt: skip
    return samples


def kernel_rates(ranks: Sequence[int], cols: int, rows: int = 1024, seconds: float = 1.0):
    """Elements per second of ram-dist's LoRA kernel (`kernels.lora.values`, numba where
    installed) in this process, one core, no I/O: a [rows, cols] bf16 block per rank."""
    import numpy as np

    from ram_dist.kernels import lora

    rng = np.random.default_rng(0)
    theta = (rng.standard_normal(rows * cols, dtype=np.float32) * 0.02).view(np.uint32)
    theta = (theta >> 16).astype(np.uint16).view(np.uint8)
    out = np.empty(rows * cols * 2, dtype=np.uint8)
    rates: dict[int, float] = {}
    for r in ranks:
        coef = rng.standard_normal((rows, r), dtype=np.float32)
        basis = rng.standard_normal((r, cols), dtype=np.float32)
        lora.values(theta, "BF16", coef, basis, np.float32(2.0), 0, "BF16", out)  # warm
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or calls < 2:
            lora.values(theta, "BF16", coef, basis, np.float32(2.0), 0, "BF16", out)
            calls += 1
        rates[r] = calls * rows * cols / elapsed
    return rates


def print_kernel(rates: dict[int, float], lora_elements: int, cores: int, floor: float | None):
    """The kernel's rate per rank and what the products of the job cost on `cores` cores:
    every targeted element, three adapters, both passes."""
    print(f"\nLoRA kernel alone (one core, no I/O), and the products of this job: "
          f"{lora_elements / 1e9:.3f} B targeted elements x {AGENTS} adapters x 2 passes "
          f"on {cores} cores, against the floor ({fmt(floor, ' s')}):\n")  # fmt: skip
    print("| rank | M elements/s per core | G float32 ops/s (2r per element) |"
          " products, both passes | / floor |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|")
    for r, rate in rates.items():
        cpu = 2 * AGENTS * lora_elements / rate / cores
        print(f"| {r} | {rate / 1e6:,.0f} | {2 * r * rate / 1e9:.1f} | {cpu:.2f} s "
              f"| {fmt(ratio(cpu, floor), 'x')} |")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{unit}"


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"


def summarise(samples: dict[int, dict[str, list[dict[str, Any]]]]) -> dict[int, dict]:
    """Per rank: medians and the ratios of the issue's targets (medians of per-repeat ratios
    where both were measured in the same repeat)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, runs in samples.items():
        row: dict[str, Any] = {}
        floor = runs.get("floor", [])
        for run, rows in runs.items():
            row[f"{run}_wall_s"] = median(rows, "wall_s")
            if run in ("adapters", "full"):
                for key in ("passes_s", "reduce_s", "map_s", "bytes_read",
                            "largest_process_rss_bytes", "worker_peak_rss_bytes",
                            "driver_peak_rss_bytes"):  # fmt: skip
                    row[f"{run}_{key}"] = median(rows, key)
            if run == "mergekit":
                row["mergekit_rss_bytes"] = median(rows, "proc_maxrss_bytes")
        adapters, full = runs.get("adapters", []), runs.get("full", [])

        def per_repeat(xs: list[dict], ys: list[dict], kx: str, ky: str) -> float | None:
            values = [ratio(x.get(kx), y.get(ky)) for x, y in zip(xs, ys, strict=False)]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        row["adapters_over_floor"] = per_repeat(adapters, floor, "passes_s", "wall_s")
        row["full_over_floor"] = per_repeat(full, floor, "passes_s", "wall_s")
        row["adapters_over_full"] = per_repeat(adapters, full, "passes_s", "passes_s")
        row["adapters_over_full_wall"] = per_repeat(adapters, full, "wall_s", "wall_s")
        mk = runs.get("mergekit", [])
        row["mergekit_over_adapters_wall"] = per_repeat(mk, adapters, "wall_s", "wall_s")
        row["mergekit_over_adapters_rss"] = per_repeat(
            mk, adapters, "proc_maxrss_bytes", "largest_process_rss_bytes"
        )
        out[rank] = row
    return out


def crossover(summary: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Least-squares fit `passes = t0 + c r` of the adapters' passes over the ranks, and the
    ranks where the rank-dependent part `c r` equals the floor (the products cost as much as
    moving the bytes), where the passes reach 1.5 floors, and where they reach the full
    checkpoints' passes."""
    points = [(r, s["adapters_passes_s"]) for r, s in summary.items()
              if s.get("adapters_passes_s") is not None]  # fmt: skip
    if len({r for r, _ in points}) < 2:
        return None
    n = len(points)
    mr = sum(r for r, _ in points) / n
    mt = sum(t for _, t in points) / n
    c = sum((r - mr) * (t - mt) for r, t in points) / sum((r - mr) ** 2 for r, _ in points)
    t0 = mt - c * mr
    floors = [s["floor_wall_s"] for s in summary.values() if s.get("floor_wall_s")]
    fulls = [s["full_passes_s"] for s in summary.values() if s.get("full_passes_s")]
    floor = statistics.median(floors) if floors else None
    full = statistics.median(fulls) if fulls else None

    def rank_at(t: float | None) -> float | None:
        return None if t is None or c <= 0 else (t - t0) / c

    return {
        "t0_s": t0,
        "s_per_rank": c,
        "floor_s": floor,
        "full_passes_s": full,
        "rank_products_equal_floor": None if floor is None or c <= 0 else floor / c,
        "rank_at_1_5_floor": rank_at(None if floor is None else 1.5 * floor),
        "rank_at_half_full": rank_at(None if full is None else 0.5 * full),
        "rank_at_full": rank_at(full),
    }


def print_tables(summary: dict[int, dict[str, Any]], samples: dict, fit: dict | None) -> None:
    print(
        "\n| rank | floor | adapters: passes (reduce + map) | wall | full: passes | wall |"
        " adapters / floor (passes) | full / floor | adapters / full (passes) | (wall) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rank, s in summary.items():
        print(
            f"| {rank} | {fmt(s.get('floor_wall_s'), ' s')} "
            f"| {fmt(s.get('adapters_passes_s'), ' s')} ({fmt(s.get('adapters_reduce_s'))} + "
            f"{fmt(s.get('adapters_map_s'))}) | {fmt(s.get('adapters_wall_s'), ' s')} "
            f"| {fmt(s.get('full_passes_s'), ' s')} | {fmt(s.get('full_wall_s'), ' s')} "
            f"| {fmt(s.get('adapters_over_floor'), 'x')} | {fmt(s.get('full_over_floor'), 'x')} "
            f"| {fmt(s.get('adapters_over_full'), 'x')} "
            f"| {fmt(s.get('adapters_over_full_wall'), 'x')} |"
        )
    print("\ntargets: adapters / floor at most 1.5x, adapters / full at most 0.5x (passes)")
    print(
        "\n| rank | adapters: bytes read | full: bytes read | adapters: largest process |"
        " full: largest process |"
    )
    print("|---:|---:|---:|---:|---:|")
    for rank, s in summary.items():
        print(f"| {rank} | {fmt(_gb(s.get('adapters_bytes_read')), ' GB')} "
              f"| {fmt(_gb(s.get('full_bytes_read')), ' GB')} "
              f"| {mib(s.get('adapters_largest_process_rss_bytes'))} "
              f"| {mib(s.get('full_largest_process_rss_bytes'))} |")  # fmt: skip
    if any("mergekit_wall_s" in s for s in summary.values()):
        print(
            "\n| rank | mergekit wall | peak RSS | ram-dist adapters wall | largest process |"
            " mergekit / ram-dist: time | memory |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rank, s in summary.items():
            print(f"| {rank} | {fmt(s.get('mergekit_wall_s'), ' s')} "
                  f"| {mib(s.get('mergekit_rss_bytes'))} | {fmt(s.get('adapters_wall_s'), ' s')} "
                  f"| {mib(s.get('adapters_largest_process_rss_bytes'))} "
                  f"| {fmt(s.get('mergekit_over_adapters_wall'), 'x')} "
                  f"| {fmt(s.get('mergekit_over_adapters_rss'), 'x')} |")  # fmt: skip
        print("target: mergekit / ram-dist at least 10x in time and in memory")
    print("\nevery sample (wall s; passes s for ram-dist):")
    for rank, runs in samples.items():
        for run, rows in runs.items():
            cells = ", ".join(
                f"{row['wall_s']:.2f}" + (f" ({row['passes_s']:.2f})" if row.get("passes_s")
                                          else "")
                for row in rows
            )  # fmt: skip
            print(f"  rank {rank} {run}: {cells}")
    if fit and fit["s_per_rank"] <= 0:
        print(
            f"\nadapters' passes ~ {fit['t0_s']:.2f} s + {fit['s_per_rank']:.3f} s x rank: they "
            "did not grow with the rank in this run (noise, or fixed costs dominate); no crossover"
        )
    elif fit:
        print(
            f"\nadapters' passes ~ {fit['t0_s']:.2f} s + {fit['s_per_rank']:.3f} s x rank "
            f"(least squares over the ranks); floor {fmt(fit['floor_s'], ' s')}, full "
            f"checkpoints' passes {fmt(fit['full_passes_s'], ' s')}.\n"
            f"  the rank-r products cost as much as the floor at rank "
            f"{fmt(fit['rank_products_equal_floor'], '', 0)}; the passes reach 1.5 floors at "
            f"rank {fmt(fit['rank_at_1_5_floor'], '', 0)}, half the full checkpoints' at rank "
            f"{fmt(fit['rank_at_half_full'], '', 0)}, the full checkpoints' at rank "
            f"{fmt(fit['rank_at_full'], '', 0)} (extrapolated where outside the measured ranks; "
            "negative: already above at rank 0)"
        )


def _gb(x: float | None) -> float | None:
    return None if x is None else x / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.generate_only:
        # Generate (or check) the inputs in a child process: generating raises this
        # process's peak RSS to gigabytes, and a process forked from it inherits that peak,
        # which wait4 would then report as every merge's.
        cmd = [sys.executable, "-m", "benchmarks.bench_lora", *argv, "--generate-only"]
        subprocess.run(cmd, check=True)
    start = time.perf_counter()
    base, layout = ensure_base(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    dims, shards = layout
    full = "full" in args.runs
    dirs = {rank: ensure_rank(args.workdir, base, layout, rank, args, full) for rank in args.rank}
    if args.generate_only:
        print(f"inputs ready in {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    tensors = sum(len(s) for s in shards)
    benches = {rank: Bench(args, base, d, tensors) for rank, d in dirs.items()}
    if "mergekit" in args.runs:
        for bench in benches.values():
            bench.write_yaml()
    samples = measure_all(benches, args.runs, args.repeats)
    summary = summarise(samples)
    fit = crossover(summary) if len(args.rank) > 1 else None
    adapter_mb = {rank: folder_bytes(d / "adapter1") / 1e6 for rank, d in dirs.items()}
    print(
        f"\nbase: {dims.params / 1e9:.3f} B params, bf16, {folder_bytes(base) / 1e9:.2f} GB; "
        f"three adapters per rank ({args.adapter_dtype}; MB each: "
        + ", ".join(f"r{r} {mb:.1f}" for r, mb in adapter_mb.items())
        + f"); ram_plus; {args.repeats} repeat(s), medians; {cpu_count()} CPUs"
    )
    print_tables(summary, samples, fit)
    rates = {}
    if args.kernel:
        lora_elements = sum(out_f * in_f for _, (out_f, in_f) in targeted(dims))
        floors = [x["floor_wall_s"] for x in summary.values() if x.get("floor_wall_s")]
        rates = kernel_rates(args.rank, dims.hidden)
        workers = args.workers or cpu_count()
        print_kernel(rates, lora_elements, workers, statistics.median(floors) if floors else None)
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {"config": config, "params": dims.params, "cpus": cpu_count(),
                  "adapter_mb": adapter_mb, "kernel_rates": rates, "samples": samples,
                  "summary": summary, "fit": fit,
                  "commands": {rank: {run: b.command(run, b.dir / f"out-{run}", 1)
                                      for run in args.runs if run != "floor"}
                               for rank, b in benches.items()}}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
