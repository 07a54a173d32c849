"""FP8 merge throughput: the passes on fine-grained FP8 checkpoints against the same merge on
bf16 checkpoints of the same shapes, in one run.

Takes the bf16 base and three agents of `benchmarks.inputs` (a Llama of ``--params``
parameters per checkpoint) and writes an FP8 copy of each, as DeepSeek-V3 stores its
weights: every linear layer's weight (``*_proj``) in e4m3 with one F32 scale per 128 x 128
block (``amax / 448``), each checkpoint quantized on its own; embeddings, norms and
``lm_head`` stay bf16; ``config.json`` declares the ``quantization_config``. Then it runs
``ram-dist merge`` (``ram_plus``, FP8 output) on both sets, alternating, and prints the wall
time of the two passes from ``merge_report.json``, their ratio (target, issue 36: FP8 at most
1.0x bf16), and the bytes each read.

Example::

    python -m benchmarks.bench_fp8 --params 1e9 --workdir /tmp/ramdist-fp8 --repeats 3

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.commands import cli_command
from benchmarks.inputs import ensure_models, model_names, safetensors_files
from benchmarks.running import run_process

BLOCK = 128
QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and F32 scales (`amax / 448` per 128 x 128 block) of a bf16 matrix."""
    r, c = x.shape
    pr, pc = -(-r // BLOCK) * BLOCK, -(-c // BLOCK) * BLOCK
    padded = torch.zeros(pr, pc, dtype=torch.float32)
    padded[:r, :c] = x
    blocks = padded.reshape(pr // BLOCK, BLOCK, pc // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    per = s.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
    return (x.float() / per).clamp(-448, 448).to(torch.float8_e4m3fn), s


def to_fp8(src: Path, dst: Path) -> None:
    """An FP8 copy of checkpoint folder `src`, shard by shard."""
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in safetensors_files(src):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                t = f.get_tensor(name)
                if t.ndim == 2 and "_proj." in name:
                    out[name], out[name + "_scale_inv"] = quantize(t)
                else:
                    out[name] = t
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
    for extra in src.iterdir():
        if extra.is_file() and not extra.name.endswith(".safetensors"):
            shutil.copy2(extra, dst / extra.name)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = QUANT
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    index = dst / "model.safetensors.index.json"
    if index.exists():
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def ensure_fp8(models_dir: Path, fp8_dir: Path) -> None:
    stamp = fp8_dir / "done.json"
    key = json.loads((models_dir / "manifest.json").read_text())["key"]
    if stamp.exists() and json.loads(stamp.read_text()) == key:
        print(f"using cached FP8 checkpoints in {fp8_dir}", flush=True)
        return
    shutil.rmtree(fp8_dir, ignore_errors=True)
    for name in model_names():
        start = time.perf_counter()
        to_fp8(models_dir / name, fp8_dir / name)
        print(f"  FP8 {name}: {time.perf_counter() - start:.1f} s", flush=True)
    stamp.write_text(json.dumps(key))


def merge(folder: Path, out: Path, log: Path, extra: list[str]) -> dict:
    cmd, env = cli_command()
    names = model_names()
    args = ["merge", "--base", str(folder / names[0]), "--out", str(out), "--overwrite"]
    for name in names[1:]:
        args += ["--task", str(folder / name)]
    wall, _ = run_process([*cmd, *args, *extra], env, log)
    report = json.loads((out / "merge_report.json").read_text())
    passes = report["passes"]
    return {
        "wall_s": wall,
        "passes_s": passes["reduce"]["wall_s"] + passes["map"]["wall_s"],
        "reduce_s": passes["reduce"]["wall_s"],
        "map_s": passes["map"]["wall_s"],
        "bytes_read": passes["reduce"]["bytes_read"] + passes["map"]["bytes_read"],
        "units": passes["map"].get("units"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=1e9, help="parameters per checkpoint (1e9)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-fp8"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shard-gb", type=float, default=1.0, help="bf16 shard size (1 GB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge-arg", action="append", default=[], help="passed to both merges")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.workdir, args.params, int(args.shard_gb * 1e9), args.seed)
    fp8_dir = args.workdir / "fp8"
    ensure_fp8(models.folder, fp8_dir)
    sets = {"bf16": models.folder, "fp8": fp8_dir}
    runs: dict[str, list[dict]] = {k: [] for k in sets}
    for r in range(args.repeats):
        for name in sets if r % 2 == 0 else reversed(list(sets)):
            out = args.workdir / f"out-{name}"
            sample = merge(sets[name], out, args.workdir / f"{name}-{r}.log", args.merge_arg)
            runs[name].append(sample)
            print(f"  {name} #{r + 1}: passes {sample['passes_s']:.2f} s, wall "
                  f"{sample['wall_s']:.2f} s", flush=True)  # fmt: skip
    med = {k: {f: statistics.median(s[f] for s in v) for f in v[0] if f != "units"}
           for k, v in runs.items()}  # fmt: skip
    print(f"\n{models.dims.params / 1e9:.2f} B parameters per checkpoint, base and three "
          f"agents, ram_plus, medians of {args.repeats}\n")  # fmt: skip
    print("| inputs | passes (s) | reduce (s) | map (s) | wall (s) | bytes read |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, m in med.items():
        print(f"| {k} | {m['passes_s']:.2f} | {m['reduce_s']:.2f} | {m['map_s']:.2f} | "
              f"{m['wall_s']:.2f} | {m['bytes_read'] / 1e9:.2f} GB |")  # fmt: skip
    ratio = med["fp8"]["passes_s"] / med["bf16"]["passes_s"]
    print(f"\nFP8 passes / bf16 passes: {ratio:.2f}x (target: at most 1.0x)")


if __name__ == "__main__":
    main()
