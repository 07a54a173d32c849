"""The fused kernels' disk cache: `python -m ram_dist.kernels.warm` fills numba's cache, a
later process running the methods as a job does loads every kernel from it instead of
compiling, the command fails loudly, and the kernels import (and cache) even where neither
the package's directory nor the user's cache directory can be written.

Every case runs in subprocesses with a cache directory of its own (numba reads
`NUMBA_CACHE_DIR` once, at import). The whole warm is the calls each kernel module declares
(`warm_calls()`; the docs' count of them is checked below): the kernels that read a merge's
inputs take them as records (`views.kernel_inputs`), one signature each whatever the
dtypes, stored forms, task count and output dtype. That cache directory starts as a copy of
the package's own cache (which the README's test command fills before the suite) less the
`FRESH` kernels, so warm compiles those into it and loads the others: the suite does not pay
the whole compile a second time. Where the package's cache lacks a kernel or is stale, warm
compiles it too; the assertions hold either way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from ram_dist.kernels import warm

pytest.importorskip("numba")

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
TESTS = Path(__file__).resolve().parent
WARM = [sys.executable, "-m", "ram_dist.kernels.warm"]
#: The kernels the job below calls (RAM's, TIES's and DELLA's take records: one signature
#: each), then the finiteness scan (a signature per width) and the LoRA product (per pair of
#: dtypes); the job calls one signature of each.
KERNELS = (
    "ram_numba._count_kernel", "ram_numba._merge_kernel", "ram_numba._merge_fp8_kernel",
    "ties_numba._stats_kernel", "ties_numba._merge_kernel", "della_numba._stats_kernel",
    "della_numba._merge_kernel",
)  # fmt: skip
SCAN, LORA = "scan_numba._count", "lora_numba.lora_values"
#: Left out of the copied cache, so always compiled here: a record kernel (whose index the
#: job below must find holding only what warm compiled) and the scan (three widths).
FRESH = ("ram_numba._count_kernel", SCAN)


def registered() -> Counter[str]:
    """How many warm-up calls each kernel module declares per kernel (`warm.calls`, nothing
    compiled): each must compile one specialization of its own."""
    return Counter(warm.name_of(kernel) for kernel, _, _ in warm.calls())


#: RAM, TIES and DELLA on base + 2 bfloat16 tasks into bfloat16, through the methods as the engine
#: calls them, and the finiteness scan; RAM's and TIES's statistics on FP8 inputs as stored
#: too (the same signature); then numba's counts of cache hits and misses per kernel; then
#: the same for a signature that was not warmed (RAM's count kernel given int32 counts).
JOB = f"""
import json, sys
import torch
sys.path.insert(0, {str(TESTS.parent / "support")!r})
from kernel_runs import della_params, run, run_rows, sparse_inputs, ties_params
from ram_dist.kernels import ram_numba, scan_numba, warm

def counts():
    return {{name: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
            for name, k in warm.dispatchers().items()}}

base, tasks = sparse_inputs(5000, (torch.bfloat16,) * 3, seed=0)
ram = {{"r": 0.1, "alpha": 0.2, "epsilon": 1e-5, "scope": "model"}}
run("ram", ram, base, tasks, [0, 1000, 5000], True, torch.bfloat16)
run("ties", ties_params(2), base, tasks, [0, 5000], True, torch.bfloat16)
run_rows("della", della_params(2), base, tasks, (50, 100), [0, 10, 50], True, torch.bfloat16)
scan_numba.nonfinite_count(base)
from ram_dist.kernels import lora
import numpy as np
lora.values(np.zeros(32, np.uint8), "BF16", np.zeros((4, 2), np.float32),
            np.zeros((2, 4), np.float32), np.float32(1), 0, "BF16", np.empty(64, np.uint8))
from ram_dist.kernels import fp8
q = np.zeros(256 * 200, np.uint8)
fp8_base = fp8.Fp8Values(q, np.ones(4, np.float32), 200, (128, 128))
fp8_tasks = [fp8.Fp8Values(q + 1, np.ones(4, np.float32), 200, (128, 128))] * 2
ram_numba.overlap_counts_nonfinite(fp8_base, fp8_tasks, 1e-5)
out = torch.empty(q.size, dtype=torch.bfloat16)
ram_numba.merge_ram(fp8_base, fp8_tasks, 1e-5, [1.0, 1.0], out)
scales = np.ones(4, np.float32).view(np.uint8)
target = fp8.Fp8Target(np.empty_like(q), "F32", scales, np.empty_like(scales))
ram_numba.merge_ram_fp8(fp8_base, fp8_tasks, 1e-5, [1.0, 1.0], target)
from ram_dist.kernels import ties_numba
ties_numba.statistics(fp8_base, fp8_tasks, ties_numba.HIGH, 1 << 15)
print(json.dumps(counts()))
from ram_dist.kernels import views
table = views.kernel_inputs(base, tasks)
hist = np.zeros((3, 3), np.int64)
ram_numba._count_kernel(table, np.float32(1e-5), hist, np.zeros(3, np.int32), 10,
                        np.zeros((0, 3), np.int64))
print(json.dumps(counts()))
"""


def run(args: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    unset = ("NUMBA_CACHE_DIR", "PYTHONPATH", "XDG_CACHE_HOME")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(
        args, env={**environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def summary(stdout: str) -> dict[str, tuple[int, int]]:
    """{kernel: (compiled, loaded)} from the warm command's output."""
    rows = re.findall(r"^(\S+)\s+(\d+) compiled\s+(\d+) loaded", stdout, re.MULTILINE)
    return {name: (int(compiled), int(loaded)) for name, compiled, loaded in rows}


def seed_from_package_cache(cache: Path) -> None:
    """Copy the package's numba cache (`ram_dist/kernels/__pycache__`) where numba looks for
    the same kernels under `NUMBA_CACHE_DIR=cache`, less the `FRESH` kernels' files. An entry
    numba cannot use (another source, a file half-written) is a miss: warm compiles it."""
    from numba.core.caching import UserProvidedCacheLocator

    kernels = REPO / "ram_dist" / "kernels"
    into = cache / UserProvidedCacheLocator.get_suitable_cache_subpath(str(kernels / "x.py"))
    into.mkdir(parents=True)
    for suffix in (".nbi", ".nbc"):
        for path in (kernels / "__pycache__").glob(f"*{suffix}"):
            if not path.name.startswith(tuple(f"{k}-" for k in FRESH)):
                shutil.copy2(path, into / path.name)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cache = tmp_path_factory.mktemp("numba-cache")
    seed_from_package_cache(cache)
    return cache, run([*WARM, "--cache-dir", str(cache)], {})


def test_warm_compiles_into_the_cache_dir(warmed):
    cache, result = warmed
    assert result.returncode == 0, result.stderr
    assert f"numba cache: {cache}" in result.stdout
    # Each declared call compiled or loaded a signature of its own: one per kernel, whatever
    # it reads and writes, but the scan's three widths and LoRA's four pairs of dtypes (two
    # calls of one signature would count one). The kernels not in the copied cache compiled.
    calls = registered()
    found = summary(result.stdout)
    assert {name: sum(counts) for name, counts in found.items()} == dict(calls)
    assert {name: found[name] for name in FRESH} == {name: (calls[name], 0) for name in FRESH}
    assert calls[SCAN] == 3 and calls[LORA] == 4
    assert {*KERNELS, SCAN, LORA} < set(calls)
    total = sum(calls.values())
    assert f"{total} specializations" in result.stdout and "0 failed" in result.stdout
    for kernel in KERNELS:
        assert list(cache.glob(f"*/{kernel}-*.nbi")), kernel
        assert list(cache.glob(f"*/{kernel}-*.nbc")), kernel


def test_a_later_job_loads_the_warmed_kernels_instead_of_compiling(warmed):
    cache, first = warmed
    assert first.returncode == 0, first.stderr
    result = run([sys.executable, "-c", JOB], {"NUMBA_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    job, after = (json.loads(line) for line in result.stdout.splitlines()[-2:])
    # Each kernel the job calls (RAM's and TIES's statistics on bf16 and on FP8 inputs as
    # stored: one signature) was found in the cache: no compilation.
    called = {*KERNELS, SCAN, LORA}
    assert job == {k: [1, 0] if k in called else [0, 0] for k in registered()}
    # A signature that was not warmed is compiled (the counts do tell the two apart).
    assert after["ram_numba._count_kernel"] == [1, 1]


def test_warm_exits_non_zero_when_it_cannot_cache(warmed, tmp_path):
    cache, first = warmed
    assert first.returncode == 0, first.stderr
    # A cache directory numba cannot use: refused before compiling anything.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = run([*WARM, "--cache-dir", str(not_a_dir)], {})
    assert result.returncode == 2 and "numba cannot cache into" in result.stderr
    assert "compiled" not in result.stdout
    # A corrupt index: that kernel's calls fail and are reported; the others load.
    broken = tmp_path / "broken"
    shutil.copytree(cache, broken)
    (index,) = broken.glob("*/ram_numba._count_kernel-*.nbi")
    index.write_bytes(b"not a numba index")
    result = run([*WARM, "--cache-dir", str(broken)], {})
    assert result.returncode == 1
    assert result.stderr.count("FAILED ram_numba._count_kernel") == 1, result.stderr
    assert "1 failed" in result.stdout
    assert summary(result.stdout)["ram_numba._merge_kernel"] == (0, 1)


def test_kernels_cache_in_the_temp_dir_when_nothing_else_is_writable(tmp_path):
    """numba refuses to import a `cache=True` module when neither the package's __pycache__
    nor ~/.cache/numba can be written; `use_writable_cache` falls back to the temp dir, and a
    later process loads from there. (Unwritable here: a file where the directory would be.)"""
    package = tmp_path / "site" / "ram_dist"
    shutil.copytree(REPO / "ram_dist", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "kernels" / "__pycache__").write_text("")
    (tmp_path / "home").write_text("")
    (tmp_path / "tmp").mkdir()
    code = textwrap.dedent("""
        import torch
        import ram_dist
        from ram_dist.kernels import scan_numba
        assert scan_numba.nonfinite_count(torch.tensor([1.0, float("inf")])) == 1
        s = scan_numba._count.stats
        print(ram_dist.__file__, s.cache_path, len(s.cache_hits), len(s.cache_misses))
    """)
    env = {"PYTHONPATH": str(tmp_path / "site"), "HOME": str(tmp_path / "home")}
    env |= {"TMPDIR": str(tmp_path / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"}
    outputs = []
    for _ in range(2):
        result = run([sys.executable, "-c", code], env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout.split())
    (where, path, hits, misses), second = outputs
    assert Path(where).is_relative_to(package)
    assert Path(path).parent == tmp_path / "tmp" / f"numba-cache-{os.getuid()}"
    assert (hits, misses) == ("0", "1") and second[2:] == ["1", "0"]


def test_the_docs_count_the_specializations_warm_compiles():
    """The number docs/architecture.md and the module's docstring give is the count of the
    kernel modules' declared calls (nothing is compiled to count them)."""
    total = sum(registered().values())
    text = (REPO / "docs" / "architecture.md").read_text()
    assert f"{total} signatures" in text
    assert f"{total} specializations" in " ".join(warm.__doc__.split())


#: A process that compiles the finiteness scan's float32 signature into an empty cache, and
#: holds the compile (numba's "numba:compile" event) until the file `go` exists, so that the
#: waiters below ask for the same signature while it compiles.
HOLDER = """
import json, sys, time
from pathlib import Path
import numpy as np
from numba.core import event
from ram_dist.kernels import scan_numba, shared_cache
here = Path(sys.argv[1])

class Hold(event.Listener):
    def on_start(self, ev):
        (here / "compiling").touch()
        while not (here / "go").exists():
            time.sleep(0.01)
    def on_end(self, ev):
        pass

event.register("numba:compile", Hold())
scan_numba.nonfinite_in(np.zeros(64, np.uint8), "F32")
s = scan_numba._count.stats
print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values()),
                  shared_cache.take_compiled()]))
"""

#: A process that asks for the same signature while the holder compiles it.
WAITER = """
import json, sys
from pathlib import Path
import numpy as np
from ram_dist.kernels import scan_numba, shared_cache
(Path(sys.argv[1]) / f"calling-{sys.argv[2]}").touch()
scan_numba.nonfinite_in(np.zeros(64, np.uint8), "F32")
s = scan_numba._count.stats
print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values()),
                  shared_cache.take_compiled()]))
"""


def _spawn(code: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    unset = ("NUMBA_CACHE_DIR", "PYTHONPATH", "XDG_CACHE_HOME")
    environ = {k: v for k, v in os.environ.items() if k not in unset} | env
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=environ, cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> None:
    """Until `path` exists (no time limit of its own: a process that died fails the test)."""
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"exited {p.returncode}: {p.stderr.read()}")
        time.sleep(0.01)


def test_the_processes_of_a_machine_compile_a_signature_once(tmp_path):
    """While one process compiles a kernel signature that is in no cache, two others that
    need it wait and then load it from the cache it wrote: one compile, not three (without
    `shared_cache`, each would compile its own, as Ray workers of a node did)."""
    cache, signals = tmp_path / "cache", tmp_path / "signals"
    signals.mkdir()
    env = {"NUMBA_CACHE_DIR": str(cache)}
    holder = _spawn(HOLDER, [str(signals)], env)
    _wait_for(signals / "compiling", [holder])
    waiters = [_spawn(WAITER, [str(signals), str(i)], env) for i in range(2)]
    for i in range(2):
        _wait_for(signals / f"calling-{i}", [holder, *waiters])
    (signals / "go").touch()
    results = []
    for p in [holder, *waiters]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert results[0] == [0, 1, {"scan_numba._count": 1}]
    assert results[1:] == [[1, 0, {}], [1, 0, {}]]
    assert list(cache.glob("*/scan_numba._count.compiling.lock"))


def test_every_cached_kernel_shares_its_compiles():
    """Each kernel module ends with `share_compiles(globals())`: every `cache=True` kernel of
    `ram_dist/kernels/` has its compiles shared."""
    import importlib
    import pkgutil

    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    import ram_dist.kernels as package
    from ram_dist.kernels import shared_cache

    cached = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Dispatcher) and value.py_func.__module__ == module.__name__:
                if not isinstance(value._cache, NullCache):
                    cached[warm.name_of(value)] = value
    assert set(warm.dispatchers()) <= set(cached)
    assert [name for name, k in cached.items() if not shared_cache.is_shared(k)] == []
