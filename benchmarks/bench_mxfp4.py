"""MXFP4 merge throughput: the passes of a gpt-oss-shaped merge on an MXFP4 base against the
same merge on a bf16 base, with the same three bf16 agents, in one run.

Writes, once per work folder, a gpt-oss-shaped model of ``--params`` parameters
(``ram_dist.synthetic.gpt_oss.GptOssDims.for_params``: 32 experts a layer, intermediate equal
to hidden, gpt-oss's names and tensor order): a bf16 base whose expert weights lie on
MXFP4's grid, three bf16 RL-like agents drawn from it (``ram_dist.synthetic.weights``, the
paper's densities), and an MXFP4 copy of the base, as gpt-oss stores it: each expert weight
``N`` [E, G*32, R] (``gate_up_proj`` [E, hidden, 2 x intermediate], ``down_proj``
[E, intermediate, hidden]) as ``N_blocks`` (U8 [E, R, G, 16], two e2m1 codes a byte, the low
nibble first) and ``N_scales`` (U8 [E, R, G], an e8m0 power of two per 32 values along axis
1, the input axis), in shards ``model-00000-of-000NN.safetensors``, with ``config.json``'s
``quantization_config: {quant_method: mxfp4}``. The base's expert values are drawn as
``0.02 * N(0, 1)``, then rounded to that grid (the scale ``2**ceil(log2(amax / 6))``, each
value to the nearest e2m1 code): the bf16 base holds exactly the values that
``kernels.mxfp4.decode`` returns from the copy (checked on every tensor as it is written),
so the two merges compute the same thing from the same values, and their outputs are
compared tensor by tensor at the end. Everything else (attention, sinks, router, norms,
embeddings, the experts' biases) is the same bf16 tensor in both bases.

Then it runs ``ram-dist merge --method ram_plus`` (bf16 output) on the two bases,
alternating, and prints the medians of ``--repeats`` of the two passes' wall time from
``merge_report.json``, their ratio (target, issue 42: MXFP4 at most 1.0x bf16), and the
bytes each read.

Example::

    python -m benchmarks.bench_mxfp4 --params 1e9 --workdir /tmp/ramdist-mxfp4 --repeats 3

from the repository root. It needs about 11 x ``--params`` bytes of disk (the bf16 base and
agents, the MXFP4 base, one output of each).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.commands import cli_command
from benchmarks.running import run_process
from ram_dist.io.names import INDEX_NAME, MODEL_CONFIG_NAME
from ram_dist.kernels import mxfp4
from ram_dist.synthetic import gpt_oss
from ram_dist.synthetic.files import plan_shards
from ram_dist.synthetic.files import shard_name as hf_shard_name
from ram_dist.synthetic.gpt_oss import GptOssDims
from ram_dist.synthetic.weights import AGENT_DENSITIES, base_tensor, task_tensor

#: Bumped whenever the same parameters would give other files.
GENERATOR_VERSION = 1
METADATA = {"format": "pt"}
#: e2m1's magnitudes by code (codes 0 to 7), and the midpoints that round to them.
MAGNITUDES = mxfp4.E2M1[:8]
MIDPOINTS = (MAGNITUDES[1:] + MAGNITUDES[:-1]) / 2
#: The largest e2m1 magnitude.
E2M1_MAX = 6.0
SETS = ("bf16", "mxfp4")


def agent_names() -> list[str]:
    return [f"agent{k + 1}" for k in range(len(AGENT_DENSITIES))]


def quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """An expert weight `x` [E, G*32, R] on MXFP4's grid: its blocks (uint8 [E, R, G, 16]),
    scales (uint8 [E, R, G]) and values (bf16 [E, G*32, R], exactly the blocks' and scales'
    decoded values). Per 32 values along axis 1, the scale is the least power of two
    `2**s` with `amax <= 6 * 2**s`; each value goes to the nearest e2m1 code of `x / 2**s`
    (a tie to the lower magnitude), its sign kept (code 8 is -0.0)."""
    e, c, r = x.shape
    g = c // mxfp4.GROUP
    v = x.float().numpy().reshape(e, g, mxfp4.GROUP, r)
    amax = np.abs(v).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        s = np.ceil(np.log2(amax / E2M1_MAX))
    s = np.where(amax > 0, s, 0).astype(np.int32)
    scaled = np.abs(np.ldexp(v, -s))
    codes = np.searchsorted(MIDPOINTS, scaled, side="left").astype(np.uint8)
    codes |= np.signbit(v).astype(np.uint8) << 3
    values = np.ldexp(mxfp4.E2M1[codes], s).reshape(e, c, r)
    # Blocks [E, R, G, 16]: the codes along axis 1 of each row r, two a byte, low nibble first.
    by_row = codes.reshape(e, c, r).transpose(0, 2, 1).reshape(e, r, g, mxfp4.GROUP)
    blocks = np.ascontiguousarray(by_row[..., 0::2] | (by_row[..., 1::2] << 4))
    scales = np.ascontiguousarray((s[:, :, 0, :] + mxfp4.BIAS).astype(np.uint8).transpose(0, 2, 1))
    decoded = mxfp4.decode(blocks.ravel(), scales.ravel(), r, g, np.empty(values.size, np.float32))
    if not np.array_equal(decoded.view(np.uint32), values.ravel().view(np.uint32)):
        raise AssertionError("the MXFP4 copy does not decode to the values it was made of")
    out = torch.from_numpy(values).to(torch.bfloat16)
    if not torch.equal(out.float().view(torch.int32), torch.from_numpy(values).view(torch.int32)):
        raise AssertionError("an MXFP4 value is not exact in bf16")
    return blocks, scales, out


def expert_weights(dims: GptOssDims) -> set[str]:
    return {f"model.layers.{n}.{w}" for n in range(dims.layers) for w in gpt_oss.MXFP4_WEIGHTS}


def _save(folder: Path, file: str, tensors: dict[str, torch.Tensor], book: dict) -> None:
    save_file(tensors, str(folder / file), metadata=METADATA)
    book["weight_map"] |= dict.fromkeys(tensors, file)
    book["total"] += sum(t.numel() * t.element_size() for t in tensors.values())


def _finish(folder: Path, book: dict, config: dict[str, Any]) -> None:
    index = {"metadata": {"total_size": book["total"]}, "weight_map": book["weight_map"]}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (folder / MODEL_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def write_models(root: Path, dims: GptOssDims, shard_bytes: int, seed: int) -> None:
    """The bf16 base, the agents and the MXFP4 base, one shard of each in memory at a time:
    `root/bf16/{base,agent1,...}` and `root/mxfp4/base` (the MXFP4 merge's agents are the
    bf16 set's, through a link)."""
    tensors = dims.tensors(mxfp4=False)
    shapes = {name: shape for name, shape, _ in tensors}
    sizes = [(name, 2 * math.prod(shape)) for name, shape, _ in tensors]
    shards = plan_shards(sizes, shard_bytes)
    experts = expert_weights(dims)
    folders = {"base": root / "bf16" / "base", "mxfp4": root / "mxfp4" / "base"}
    folders |= {name: root / "bf16" / name for name in agent_names()}
    for f in folders.values():
        f.mkdir(parents=True)
    books = {k: {"weight_map": {}, "total": 0} for k in folders}
    for k, shard in enumerate(shards, start=1):
        start = time.perf_counter()
        base: dict[str, torch.Tensor] = {}
        packed: dict[str, torch.Tensor] = {}
        for name in shard:
            x = base_tensor(name, shapes[name], seed, torch.bfloat16)
            if name in experts:
                blocks, scales, x = quantize(x)
                packed[name + "_blocks"] = torch.from_numpy(blocks)
                packed[name + "_scales"] = torch.from_numpy(scales)
            else:
                packed[name] = x
            base[name] = x
        _save(folders["base"], hf_shard_name(k, len(shards)), base, books["base"])
        _save(folders["mxfp4"], gpt_oss.shard_name(k, len(shards)), packed, books["mxfp4"])
        del packed
        for a, (name, density) in enumerate(zip(agent_names(), AGENT_DENSITIES, strict=True)):
            agent = {n: task_tensor(t, n, density, seed + 1 + a) for n, t in base.items()}
            _save(folders[name], hf_shard_name(k, len(shards)), agent, books[name])
        print(f"  shard {k}/{len(shards)}: {time.perf_counter() - start:.1f} s", flush=True)
    for name, folder in folders.items():
        _finish(folder, books[name], dims.config(mxfp4=name == "mxfp4"))
    for name in agent_names():
        (root / "mxfp4" / name).symlink_to(Path("..") / "bf16" / name)


def ensure_models(workdir: Path, params: float, shard_bytes: int, seed: int) -> GptOssDims:
    """The bases and agents under `workdir/models`, unless an identical set is there."""
    dims = GptOssDims.for_params(params)
    root = workdir / "models"
    key = {
        "generator_version": GENERATOR_VERSION,
        "params": params,
        "shard_bytes": shard_bytes,
        "seed": seed,
        "densities": list(AGENT_DENSITIES),
    }
    stamp = root / "done.json"
    if stamp.exists() and json.loads(stamp.read_text()) == key:
        print(f"using cached checkpoints in {root}", flush=True)
        return dims
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"generating a bf16 base, {len(AGENT_DENSITIES)} agents and an MXFP4 base: "
        f"{dims.params / 1e9:.3f} B params each (hidden {dims.hidden}, {dims.layers} layers of "
        f"{dims.experts} experts, vocab {dims.vocab}) in {root}",
        flush=True,
    )
    write_models(root, dims, shard_bytes, seed)
    stamp.write_text(json.dumps(key))
    return dims


def merge(folder: Path, out: Path, log: Path, extra: list[str]) -> dict:
    cmd, env = cli_command()
    args = ["merge", "--base", str(folder / "base"), "--out", str(out), "--overwrite"]
    for name in agent_names():
        args += ["--task", str(folder / name)]
    args += ["--method", "ram_plus"]
    wall, _ = run_process([*cmd, *args, *extra], env, log)
    report = json.loads((out / "merge_report.json").read_text())
    passes = report["passes"]
    return {
        "wall_s": wall,
        "passes_s": passes["reduce"]["wall_s"] + passes["map"]["wall_s"],
        "reduce_s": passes["reduce"]["wall_s"],
        "map_s": passes["map"]["wall_s"],
        "bytes_read": passes["reduce"]["bytes_read"] + passes["map"]["bytes_read"],
    }


def same_outputs(a: Path, b: Path) -> list[str]:
    """Names of the tensors whose bytes differ between outputs `a` and `b` (or that one
    lacks)."""
    where: dict[Path, dict[str, Path]] = {}
    for folder in (a, b):
        index = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
        where[folder] = {name: folder / file for name, file in index.items()}
    differ = sorted(set(where[a]) ^ set(where[b]))
    for name in sorted(set(where[a]) & set(where[b])):
        tensors = []
        for folder in (a, b):
            with safe_open(str(where[folder][name]), "pt") as f:
                tensors.append(f.get_tensor(name))
        x, y = (t.contiguous().view(-1).view(torch.uint8) for t in tensors)
        if tensors[0].dtype != tensors[1].dtype or tensors[0].shape != tensors[1].shape:
            differ.append(name)
        elif not torch.equal(x, y):
            differ.append(name)
    return differ


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=1e9, help="parameters per checkpoint (1e9)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-mxfp4"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shard-gb", type=float, default=1.0, help="bf16 shard size (1 GB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-arg", action="append", default=[], help="passed to both merges")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    dims = ensure_models(args.workdir, args.params, int(args.shard_gb * 1e9), args.seed)
    print(f"inputs ready in {time.perf_counter() - start:.0f} s", flush=True)
    sets = {name: args.workdir / "models" / name for name in SETS}
    runs: dict[str, list[dict]] = {k: [] for k in sets}
    for r in range(args.repeats):
        for name in sets if r % 2 == 0 else reversed(list(sets)):
            out = args.workdir / f"out-{name}"
            sample = merge(sets[name], out, args.workdir / f"{name}-{r}.log", args.merge_arg)
            runs[name].append(sample)
            print(f"  {name} #{r + 1}: passes {sample['passes_s']:.2f} s (reduce "
                  f"{sample['reduce_s']:.2f}, map {sample['map_s']:.2f}), wall "
                  f"{sample['wall_s']:.2f} s", flush=True)  # fmt: skip
    differ = same_outputs(args.workdir / "out-bf16", args.workdir / "out-mxfp4")
    med = {k: {f: statistics.median(s[f] for s in v) for f in v[0]} for k, v in runs.items()}
    print(f"\n{dims.params / 1e9:.2f} B parameters per checkpoint (hidden {dims.hidden}, "
          f"{dims.layers} layers of {dims.experts} experts), base and three bf16 agents, "
          f"ram_plus, medians of {args.repeats}\n")  # fmt: skip
    print("| base | passes (s) | reduce (s) | map (s) | wall (s) | bytes read |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, m in med.items():
        print(f"| {k} | {m['passes_s']:.2f} | {m['reduce_s']:.2f} | {m['map_s']:.2f} | "
              f"{m['wall_s']:.2f} | {m['bytes_read'] / 1e9:.2f} GB |")  # fmt: skip
    for k, v in runs.items():
        print(f"{k} passes: " + ", ".join(f"{s['passes_s']:.2f}" for s in v) + " s")
    ratio = med["mxfp4"]["passes_s"] / med["bf16"]["passes_s"]
    print(f"\nMXFP4 passes / bf16 passes: {ratio:.2f}x (target: at most 1.0x)")
    if differ:
        print(f"outputs differ in {len(differ)} tensors, e.g. {differ[:3]}")
    else:
        print("outputs: every tensor the same bytes")


if __name__ == "__main__":
    main()
