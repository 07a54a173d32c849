"""mergekit's geometric and sparsifying methods against mergekit and against the I/O floor of
their own passes, in one run (issue 34): by default ``slerp``, ``model_stock`` and ``della``.

Inputs: the bf16 Llama base and three agents of ``benchmarks.inputs`` (``--params`` each,
generated once in ``--workdir`` and reused). ``slerp`` merges the base and the first agent;
the others the base and all three. Then, ``--repeats`` times, in an order that rotates by one
each repeat, for each method of ``--methods``:

* ``floor:METHOD``: read the method's inputs once with plain buffered reads, and write the
  base's bytes once; the floor of the method's passes is ``read_pass_s * passes + write_s``,
  where ``passes`` is what the ram-dist run of the same repeat read over what one pass reads
  (its reduce rounds that read, plus the map pass);
* ``ramdist:METHOD``: ``ram-dist merge`` as a subprocess, wall time and peak RSS from wait4,
  the passes' time from ``merge_report.json``;
* ``mergekit:METHOD``: ``mergekit-yaml`` on the same inputs with the same parameters
  (``dtype: float32``, ``out_dtype: bfloat16``), under ``benchmarks/mergekit_wrapper.py``.

Prints per method the medians and the ratios: mergekit / ram-dist wall time (target: at
least 5) and ram-dist's passes / their floor (target: at most 2).

Example::

    python -m benchmarks.bench_methods --params 0.5e9 --repeats 1 --workdir /tmp/ramdist-bench

from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from benchmarks.commands import WRAPPER, cli_command, mergekit_options
from benchmarks.inputs import Models, ensure_models, model_names, safetensors_files
from benchmarks.running import (
    READ_BLOCK,
    check_output,
    cpu_count,
    mergekit_figures,
    ramdist_figures,
    read_files,
    run_process,
    warm_page_cache,
    write_bytes,
)

#: Per method: how many agents it merges, ram-dist's flags, mergekit's parameters (top level
#: and per model): the same merge in both tools.
METHODS: dict[str, dict[str, Any]] = {
    "slerp": {"agents": 1, "flags": ["--t", "0.3"], "top": {"t": 0.3}, "each": {}},
    "model_stock": {"agents": 3, "flags": [], "top": {}, "each": {}},
    "della": {
        "agents": 3,
        "flags": [
            "--density",
            "0.5",
            "--della-epsilon",
            "0.1",
            "--lambda",
            "1.0",
            "--weight",
            "1.0",
        ],
        "top": {"lambda": 1.0},
        "each": {"density": 0.5, "epsilon": 0.1, "weight": 1.0},
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=0.5e9, help="parameters per model")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-bench"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default="slerp,model_stock,della")
    p.add_argument("--no-mergekit", action="store_true", help="measure ram-dist and floor only")
    p.add_argument("--shard-mb", type=int, default=2000, help="max shard size of the inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--merge-arg", action="append", default=[], help="extra argument for ram-dist merge"
    )
    p.add_argument(
        "--mergekit-arg", action="append", default=[], help="extra argument for mergekit-yaml"
    )
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    return args


def _agents(models: Models, method: str) -> list[Path]:
    return [models.folder / n for n in model_names()[1 : 1 + METHODS[method]["agents"]]]


def _inputs(models: Models, method: str) -> list[Path]:
    folders = [models.folder / "base", *_agents(models, method)]
    return [p for folder in folders for p in safetensors_files(folder)]


def ramdist_command(cli: list[str], models: Models, method: str, out: Path, extra: list[str]):  # noqa: ANN201
    argv = ["merge", "--base", str(models.folder / "base"), "--out", str(out), "--method", method]
    for agent in _agents(models, method):
        argv += ["--task", str(agent)]
    return cli + argv + METHODS[method]["flags"] + extra


def mergekit_yaml(models: Models, method: str) -> dict[str, Any]:
    spec = METHODS[method]
    each = spec["each"]
    return {
        "merge_method": method,
        "base_model": str(models.folder / "base"),
        "models": [
            {"model": str(a), **({"parameters": dict(each)} if each else {})}
            for a in _agents(models, method)
        ],
        **({"parameters": dict(spec["top"])} if spec["top"] else {}),
        "dtype": "float32",
        "out_dtype": "bfloat16",
    }


def measure_floor(inputs: list[Path], out_bytes: int, scratch: Path) -> dict[str, Any]:
    """One plain read of `inputs` and one write of `out_bytes`, timed apart."""
    buf = bytearray(READ_BLOCK)
    start = time.perf_counter()
    read = read_files(inputs, buf)
    t_read = time.perf_counter()
    write_bytes(scratch, out_bytes, buf)
    end = time.perf_counter()
    scratch.unlink()
    return {"read_pass_s": t_read - start, "write_s": end - t_read, "read_pass_bytes": read}


def measure(
    args: argparse.Namespace, models: Models, method: str, tool: str, repeat: int
) -> dict[str, Any]:
    cli, env = cli_command(None)
    out = args.workdir / "out" / f"{tool}-{method}"
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = args.workdir / f"{tool}-{method}_{repeat}.log"
    if tool == "ramdist":
        cmd = ramdist_command(cli, models, method, out, list(args.merge_arg))
        wall, usage = run_process(cmd, env, log)
        report = json.loads((out / "merge_report.json").read_text())
        sample = ramdist_figures(report, wall, usage.ru_maxrss * 1024, cpu_count())
    else:
        config = args.workdir / f"mergekit_{method}.yaml"
        config.write_text(yaml.safe_dump(mergekit_yaml(models, method), sort_keys=False))
        stats = args.workdir / f"mergekit-{method}_{repeat}.io.json"
        mk = [str(config), str(out), *mergekit_options(args)]
        cmd = [sys.executable, str(WRAPPER), str(stats), "--", *mk]
        wall, usage = run_process(cmd, env, log)
        sample = mergekit_figures(json.loads(stats.read_text()), wall, usage.ru_maxrss * 1024)
    sample |= check_output(out, models.tensors)
    shutil.rmtree(out, ignore_errors=True)
    return sample


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.unit_mb = None
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.workdir, args.params, args.shard_mb * 10**6, args.seed)
    base_bytes = sum(p.stat().st_size for p in safetensors_files(models.folder / "base"))
    tools = ["floor", "ramdist"] + ([] if args.no_mergekit else ["mergekit"])
    runs = [(m, t) for m in args.methods for t in tools]
    warm_page_cache(models)
    samples: dict[str, list[dict[str, Any]]] = {f"{t}:{m}": [] for m, t in runs}
    for r in range(args.repeats):
        k = r % len(runs)
        for method, tool in runs[k:] + runs[:k]:
            if tool == "floor":
                scratch = args.workdir / "floor_out.bin"
                sample = measure_floor(_inputs(models, method), base_bytes, scratch)
            else:
                sample = measure(args, models, method, tool, r + 1)
            samples[f"{tool}:{method}"].append(sample)
            shown = sample.get("wall_s", sample.get("read_pass_s"))
            print(f"repeat {r + 1}/{args.repeats}: {tool}:{method} {shown:.2f} s", flush=True)
    summary = summarize(args, samples)
    print(f"\n{models.dims.params / 1e9:.3f} B params per checkpoint, {cpu_count()} CPUs")
    for method, row in summary.items():
        print(f"{method}: " + ", ".join(f"{k} {_shown(k, v)}" for k, v in row.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"samples": samples, "summary": summary}, indent=1))
    return 0


def summarize(
    args: argparse.Namespace, samples: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Per method, medians over the repeats of each figure and ratio."""
    out: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        floors, ramdist = samples[f"floor:{method}"], samples[f"ramdist:{method}"]
        rows: list[dict[str, Any]] = []
        for i, (floor, rd) in enumerate(zip(floors, ramdist, strict=True)):
            passes_read = rd["bytes_read"] / floor["read_pass_bytes"]
            floor_s = floor["read_pass_s"] * passes_read + floor["write_s"]
            row = {
                "ramdist_wall_s": rd["wall_s"],
                "ramdist_passes_s": rd["passes_s"],
                "passes_read": passes_read,
                "floor_s": floor_s,
                "passes_over_floor": rd["passes_s"] / floor_s,
                "ramdist_rss_bytes": rd["largest_process_rss_bytes"],
            }
            if not args.no_mergekit:
                mk = samples[f"mergekit:{method}"][i]
                row |= {
                    "mergekit_wall_s": mk["wall_s"],
                    "mergekit_over_ramdist": mk["wall_s"] / rd["wall_s"],
                    "mergekit_rss_bytes": mk["largest_process_rss_bytes"],
                }
            rows.append(row)
        out[method] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def _shown(key: str, value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if key.endswith("_bytes") else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
