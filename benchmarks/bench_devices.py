"""Where the units run: the passes of one merge with `--device cpu`, `auto` and `cuda`, in one
run, for a method the fused kernels take (`ram_plus`) and one they do not (`ties` with L1
rescaling, density 0.5).

Takes the bf16 base and three agents of `benchmarks.inputs` (a Llama of ``--params``
parameters per checkpoint) and merges them in this process on a Ray it starts: with the
machine's GPUs, or, with ``--fake-gpus N``, N GPUs Ray is told exist (no CUDA: the GPU
workers then compute the eager rule on the CPU, which measures the scheduling, not a GPU).
Prints, per method and device, the passes' wall time (median of ``--repeats``, the devices
alternating), its ratio to ``cpu``, the units each pass ran on CPUs and on GPUs, the GPU
worker processes the job had, and their busy share (the larger of the two passes'); and
checks that the bytes are the same. One untimed merge per method first compiles the kernels
and starts Ray's CPU workers; GPU workers start with each job, and their start is part of
its time.

Example::

    python -m benchmarks.bench_devices --params 1e8 --fake-gpus 2 --cpus 2

from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
from pathlib import Path

import ray

from benchmarks.inputs import ensure_models, model_names

DEVICES = ("cpu", "auto", "cuda")


def merge(folder: Path, out: Path, method: str, device: str) -> dict:
    from ram_dist.api import run_merge
    from ram_dist.planning.config import MergeConfig

    names = model_names()
    params = {"density": 0.5, "rescale": True} if method == "ties" else {}
    config = MergeConfig(
        base=str(folder / names[0]), tasks=tuple(str(folder / n) for n in names[1:]),
        out=str(out), method=method, parameters=params, device=device, overwrite=True,
    )  # fmt: skip
    report = run_merge(config).data
    passes = report["passes"]
    digest = hashlib.sha256()
    for shard in sorted(out.glob("*.safetensors")):
        digest.update(shard.read_bytes())
    return {
        "passes_s": sum(p["wall_s"] for p in passes.values()),
        "on_cpu": "/".join(str(p["units_on_cpu"]) for p in passes.values()),
        "on_gpu": "/".join(str(p["units_on_gpu"]) for p in passes.values()),
        "gpu_workers": report["device"]["gpu_worker_processes"],
        "busy": max((p["gpu_busy_share"] or 0.0) for p in passes.values()),
        "device": report["device"]["device"],
        "digest": digest.hexdigest(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=1e8, help="parameters per checkpoint (1e8)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/ramdist-devices"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpus", type=int, default=None, help="Ray's CPUs (default: all)")
    p.add_argument("--fake-gpus", type=int, default=None, help="GPUs Ray is told exist")
    p.add_argument("--method", action="append", default=None, help="ram_plus and ties")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = ensure_models(args.workdir, args.params, int(1e9), 0)
    ray.init(address="local", num_cpus=args.cpus, num_gpus=args.fake_gpus, include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        raise SystemExit("no GPU: run on a machine with one, or pass --fake-gpus N")
    rows = []
    for method in args.method or ["ram_plus", "ties"]:
        runs: dict[str, list[dict]] = {d: [] for d in DEVICES}
        # untimed: compiles the kernels and starts the CPU workers, which every device reuses
        merge(models.folder, args.workdir / f"out-{method}-warm", method, "cpu")
        for r in range(args.repeats):
            for device in DEVICES if r % 2 == 0 else reversed(DEVICES):
                out = args.workdir / f"out-{method}-{device}"
                runs[device].append(merge(models.folder, out, method, device))
                print(f"  {method} {device} #{r + 1}: {runs[device][-1]['passes_s']:.2f} s",
                      flush=True)  # fmt: skip
        digests = {s["digest"] for v in runs.values() for s in v}
        assert len(digests) == 1, f"{method}: the devices gave different bytes"
        cpu = statistics.median(s["passes_s"] for s in runs["cpu"])
        for device, samples in runs.items():
            wall = statistics.median(s["passes_s"] for s in samples)
            last = samples[-1]
            rows.append(
                f"| {method} | {device} ({last['device']}) | {wall:.2f} | {wall / cpu:.2f}x | "
                f"{last['on_cpu']} | {last['on_gpu']} | {last['gpu_workers']} | "
                f"{last['busy']:.2f} |"
            )
    cpus = int(ray.cluster_resources().get("CPU", 0))
    kind = f"{args.fake_gpus} fake GPU(s)" if args.fake_gpus else f"{gpus} GPU(s)"
    print(f"\n{models.dims.params / 1e9:.2f} B parameters per checkpoint, base and three agents, "
          f"{cpus} CPU(s) and {kind}, medians of {args.repeats}; the same bytes on every "
          "device\n")  # fmt: skip
    print("| method | --device (chosen) | passes (s) | / cpu | units on CPUs (reduce/map) | "
          "units on GPUs | GPU worker processes | GPU busy share |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
