"""Wall time and peak memory of ``ram-dist plan`` on a Llama-3.1-405B base and three tasks.

Writes, in a temporary folder, four checkpoints with the real Llama-3.1-405B layout (126
layers, hidden 16384, 128 heads, 8 KV heads, intermediate 53248, vocab 128256, untied
``lm_head``, bf16; Hugging Face ``LlamaForCausalLM`` names) in 191 shards each with a
``model.safetensors.index.json``, as sparse files: each shard's real safetensors header,
then ``truncate`` to its full size (about 4.2 GB of holes, no data). Then it runs
``ram-dist plan --base B --task T1 --task T2 --task T3 --chunk-mb 256`` as a subprocess and
prints its wall time, CPU time and peak RSS (``os.wait4``) as a Markdown table, beside the
same for a bare import of ram-dist's modules (what every command pays first). Target: at most
5 s and 1 GiB. Every tensor-free step of a merge is in it: listing, index and header reads,
the checks, the layout, the plan of the work units. The shards hold consecutive tensors,
about equal in bytes (the real checkpoint's exact split differs a little).

Example::

    python benchmarks/bench_plan.py --repeats 3
    python benchmarks/bench_plan.py --profile /tmp/plan.prof   # then: python -m pstats ...
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import cli_command, run_process  # noqa: E402

LAYERS = 126
HIDDEN = 16384
HEADS = 128
KV_HEADS = 8
INTERMEDIATE = 53248
VOCAB = 128256
SHARDS = 191
ROLES = ("base", "task1", "task2", "task3")
INDEX_NAME = "model.safetensors.index.json"
#: What every `ram-dist` command imports before it does anything (torch, Ray, numba).
IMPORTS = "import ram_dist.cli, ram_dist.engine.driver, ram_dist.report"


def llama_405b() -> list[tuple[str, list[int]]]:
    """`(name, shape)` of every tensor, in the order of the Hugging Face checkpoint."""
    kv = HIDDEN // HEADS * KV_HEADS  # 1024
    tensors = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        tensors += [
            (p + "input_layernorm.weight", [HIDDEN]),
            (p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN]),
            (p + "self_attn.k_proj.weight", [kv, HIDDEN]),
            (p + "self_attn.v_proj.weight", [kv, HIDDEN]),
            (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN]),
            (p + "mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "mlp.up_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, INTERMEDIATE]),
        ]
    tensors += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    return tensors


def shard(tensors: list[tuple[str, list[int]]]) -> list[list[tuple[str, list[int]]]]:
    """`SHARDS` shards of consecutive tensors, about equal in bytes: a tensor goes to the shard
    its first byte falls in. No tensor is larger than a shard's share, so none is empty."""
    sizes = [2 * _numel(shape) for _, shape in tensors]
    total = sum(sizes)
    shards: list[list[tuple[str, list[int]]]] = [[] for _ in range(SHARDS)]
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        shards[min(SHARDS - 1, offset * SHARDS // total)].append(tensor)
        offset += size
    if not all(shards):
        raise RuntimeError("an empty shard: the layout does not fit the shard count")
    return shards


def write_checkpoint(folder: Path, shards: list[list[tuple[str, list[int]]]]) -> None:
    """Sparse safetensors shards and the index."""
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor, shape in tensors:
            size = 2 * _numel(shape)
            header[tensor] = {
                "dtype": "BF16",
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tensor] = name
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)  # safetensors pads the header to 8 bytes
        path = folder / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(body)) + body)
        os.truncate(path, 8 + len(body) + offset)  # the tensor bytes: a hole
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))


def _measure(cmd: list[str], env: dict[str, str], log: Path) -> list[float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS MiB of one run of `cmd`."""
    wall, usage = run_process(cmd, env, log)
    return [wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024]  # maxrss: KiB


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--repeats", type=int, default=3, help="runs of `ram-dist plan` (3)")
    parser.add_argument("--chunk-mb", default="256", help="`--chunk-mb` of the plan (256)")
    parser.add_argument("--cli", help='run this instead of ram-dist (e.g. "env PYTHONPATH=...")')
    parser.add_argument("--profile", help="run once more under cProfile, writing this file")
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-plan-"))
    try:
        shards = shard(llama_405b())
        folders = [root / role for role in ROLES]
        if not all((f / INDEX_NAME).exists() for f in folders):  # else: written by an earlier run
            for f in folders:
                shutil.rmtree(f, ignore_errors=True)
                write_checkpoint(f, shards)
        paths = [p for f in folders for p in f.glob("*.safetensors")]
        files, logical = len(paths), sum(p.stat().st_size for p in paths)
        cmd, env = (shlex.split(args.cli), dict(os.environ)) if args.cli else cli_command()
        argv = ["plan", "--base", str(folders[0])]
        for f in folders[1:]:
            argv += ["--task", str(f)]
        argv += ["--chunk-mb", args.chunk_mb]
        imports = None if args.cli else [sys.executable, "-c", IMPORTS]
        rows: list[list[float]] = []
        for k in range(args.repeats):
            row = _measure([*cmd, *argv], env, root / f"plan-{k}.log")
            if imports is not None:
                row += _measure(imports, env, root / f"imports-{k}.log")
            rows.append(row)
        if args.profile:
            if args.cli:
                raise SystemExit("--profile runs this interpreter's ram_dist; drop --cli")
            profiled = [sys.executable, "-m", "cProfile", "-o", os.path.abspath(args.profile)]
            run_process([*profiled, "-m", "ram_dist.cli", *argv], env, root / "plan-profile.log")
        print(
            f"Llama-3.1-405B layout, base + 3 tasks: {files} files, "
            f"{logical / 1e12:.2f} TB logical (sparse), `--chunk-mb {args.chunk_mb}`\n"
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
        for line in (root / "plan-0.log").read_text().splitlines():
            if line.startswith(("tensors:", "work units:")):
                print(line)
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
