"""`benchmarks/gpu_check.py`, the prepared check for a machine with a GPU, runs end to end here
with a fake GPU (no CUDA): the exactness tests are all skipped and it exits 2 saying so, the
devices' table comes from a real `bench_devices` run, and its figures are written as JSON and
as an entry for benchmarks/RESULTS.md. On a machine with CUDA the same command is the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), "--minutes", "5",
         "--params", "2e5", "--fake-gpus", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    return done, out


def test_without_cuda_it_exits_2_and_says_nothing_was_compared(checked):
    done, out = checked
    assert done.returncode == 2, done.stderr[-2000:]
    assert "no CUDA here: the exactness tests compared nothing" in done.stderr
    found = json.loads((out / "gpu_check.json").read_text())
    assert found["machine"]["cuda"] is False and found["machine"]["gpus"] == []
    tests = found["exactness"]["tests"]
    assert len(tests) > 50, "every method's case is collected"
    assert {t["outcome"] for t in tests} == {"skipped"}
    assert not found["exactness"]["timed_out"]


def test_the_devices_table_comes_from_bench_devices(checked):
    _, out = checked
    bench = json.loads((out / "gpu_check.json").read_text())["bench_devices"]
    assert bench["rc"] == 0 and not bench["timed_out"]
    caption, blank, header, rule, *rows = bench["table"]
    assert "1 fake GPU(s)" in caption and "the same bytes on every device" in caption
    assert blank == "" and header.startswith("| method |") and rule.startswith("|---")
    cells = [r.strip("|").split("|") for r in rows]
    assert [(c[0].strip(), c[1].split()[0]) for c in cells] == [
        (m, d) for m in ("ram_plus", "ties") for d in ("cpu", "auto", "cuda")
    ]
    assert all(c[3].strip() == "1.00x" for c in cells if c[1].split()[0] == "cpu")


def test_the_entry_for_results_md_holds_the_counts_and_the_table(checked):
    _, out = checked
    entry = (out / "gpu_check.md").read_text()
    found = json.loads((out / "gpu_check.json").read_text())
    skipped = len(found["exactness"]["tests"])
    assert entry.startswith(f"## {found['date']}: gpu_check on no CUDA\n")
    assert f"0 passed, 0 failed, {skipped} skipped" in entry
    assert "\n".join(found["bench_devices"]["table"]) in entry
