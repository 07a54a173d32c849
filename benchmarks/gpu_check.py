"""The prepared check for a machine with a GPU: run it first, as one command, when one is at hand.

    python -m benchmarks.gpu_check --out gpu-check [--minutes 8] [--params 1e8]

It runs, within ``--minutes`` in all:

1. ``tests/exactness/test_gpu_exact.py``: every method of the registry, fused and eager, on
   CUDA against the CPU's bytes, on bf16, fp16, fp32 and mixed inputs, on FP8 and quantized
   inputs, and with LoRA adapters whose products run on the GPU;
2. ``benchmarks.bench_devices`` (``--repeats 1``): the passes with ``--device cpu``, ``auto``
   and ``cuda``, and their ratios.

and writes into ``--out``: ``gpu_check.json`` (the machine, each test's outcome and time, the
devices' table) and ``gpu_check.md``, an entry for ``benchmarks/RESULTS.md`` (newest first).
Each step gets what is left of the time, the exactness tests at most two thirds of it; a step
cut short says so. Exits 0 when the tests ran to the end with none failed and the devices gave the
same bytes, 1 when a test failed or a step did not finish, 2 when the machine has no CUDA (the
exactness tests then compare nothing: ``--fake-gpus N`` still runs the devices' scheduling
with N GPUs Ray is told exist, as ``bench_devices`` does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXACTNESS = "tests/exactness/test_gpu_exact.py"


def machine() -> dict[str, Any]:
    """What ran the check: the GPUs CUDA sees, torch's versions, the CPU."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            named = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
            cpu = next(named, cpu)
    except OSError:
        pass
    cuda = torch.cuda.is_available()
    return {
        "cuda": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu": cpu,
        "cpus": os.cpu_count(),
    }


def run_step(command: list[str], timeout_s: float, log: Path) -> dict[str, Any]:
    """`command` from the repository root, its output into `log`: (rc, wall_s, timed_out).
    At the time limit it is interrupted as Ctrl-C would (pytest then still writes its report
    of the tests that ran), and killed if it has not stopped 30 s later."""
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "timed_out": timed_out}


def test_outcomes(junit: Path) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML report: its id, outcome and seconds."""
    if not junit.exists():
        return []
    found = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            if case.find(kind) is not None:
                outcome = {"failure": "failed", "error": "failed"}.get(kind, kind)
        found.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "s": float(case.get("time") or 0)})  # fmt: skip
    return found


def devices_table(log: Path) -> list[str]:
    """bench_devices' table: its caption and rows, as printed."""
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    start = next((i for i, ln in enumerate(lines) if "parameters per checkpoint" in ln), None)
    if start is None:
        return []
    return [lines[start], "", *(ln for ln in lines[start + 1 :] if ln.startswith("|"))]


def entry(found: dict[str, Any]) -> str:
    """`found` as a RESULTS.md entry."""
    m, tests = found["machine"], found["exactness"]["tests"]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    gpus = ", ".join(m["gpus"]) or "no CUDA"
    lines = [
        f"## {found['date']}: gpu_check on {gpus}",
        "",
        f"`python -m benchmarks.gpu_check` on {gpus} (torch {m['torch']}, CUDA "
        f"{m['torch_cuda']}), {m['cpus']} CPUs ({m['cpu']}).",
        "",
        f"- `{EXACTNESS}`: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {found['exactness']['wall_s']} s"
        + (" (cut short by the time limit)" if found["exactness"]["timed_out"] else "")
        + ".",
    ]
    lines += [f"  - failed: `{t['id']}`" for t in tests if t["outcome"] == "failed"]
    bench = found["bench_devices"]
    lines.append(
        f"- `bench_devices`: {bench['wall_s']} s"
        + (" (cut short by the time limit)" if bench["timed_out"] else "")
        + ("." if bench["rc"] == 0 else f", exit {bench['rc']}.")
    )
    if bench["table"]:
        lines += ["", *bench["table"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the folder for the figures")
    p.add_argument("--minutes", type=float, default=8.0, help="time for the whole check (8)")
    p.add_argument("--params", type=float, default=1e8, help="bench_devices' model size (1e8)")
    p.add_argument("--fake-gpus", type=int, default=None, help="bench_devices' fake GPUs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.minutes * 60
    found: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine()}

    junit = args.out / "gpu_exact.xml"
    budget = (deadline - time.monotonic()) * 2 / 3
    # The file uses no hypothesis: its plugin's import and per-test hooks (1 to 3 s of CPU) skipped.
    step = run_step([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                     "no:hypothesispytest", EXACTNESS, f"--junitxml={junit}"], budget,
                    args.out / "gpu_exact.log")  # fmt: skip
    found["exactness"] = {**step, "tests": test_outcomes(junit)}

    log = args.out / "bench_devices.log"
    command = [sys.executable, "-m", "benchmarks.bench_devices", "--repeats", "1",
               "--params", str(args.params), "--workdir", str(args.out / "devices")]  # fmt: skip
    if args.fake_gpus:
        command += ["--fake-gpus", str(args.fake_gpus)]
    step = run_step(command, max(deadline - time.monotonic(), 1), log)
    found["bench_devices"] = {**step, "table": devices_table(log)}

    (args.out / "gpu_check.json").write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")
    (args.out / "gpu_check.md").write_text(entry(found), encoding="utf-8")
    print(entry(found))
    if not found["machine"]["cuda"]:
        print("no CUDA here: the exactness tests compared nothing", file=sys.stderr)
        return 2
    tests = found["exactness"]["tests"]
    complete = not found["exactness"]["timed_out"] and found["bench_devices"]["rc"] == 0
    passed = any(t["outcome"] == "passed" for t in tests)
    ok = complete and passed and not any(t["outcome"] == "failed" for t in tests)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
