"""What a merge does while Ray starts: the driver imports its engine without torch, and the
checks (`driver.prepare`) begin torch's import in a thread of their own (`preload`), beside
themselves and Ray's start (`runtime.ray_session`); the reduce pass's first tasks are sent
without waiting for torch (a reduce pass ships no NaN bits); the workers are asked for as
soon as Ray is up, while the checks may still run (on a running Ray, before the checks:
connecting takes hundredths of a second), and an embedded Ray's workers load the kernels as
they start (`worker_preload`); `ram-dist demo` makes its inputs in the checks' thread. Each,
on the way from Ray's start to the first task, costs about a second."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import ray
from builders import build_model_set

from ram_dist.engine import runtime

IMPORTS = """
import sys
from ram_dist import api
from ram_dist.engine import driver, passes, preload, runtime
from ram_dist.planning import job as planning
from ram_dist.planning.config import MergeConfig
config = MergeConfig(base=sys.argv[1], tasks=tuple(sys.argv[2:]), method="ram_plus")
print("torch" in sys.modules)
job = planning.prepare(config)  # the plan alone, no preload begun
flags = passes.work_flags(job, writes=False)  # what the reduce pass ships
print("torch" in sys.modules, flags.fused, flags.bf16_nan)
driver.prepare(config)
preload.start().join()  # the thread `driver.prepare` began, not another
print("torch" in sys.modules, passes.work_flags(job).bf16_nan == preload.bf16_nan())
"""


def test_the_checks_begin_torchs_import_and_the_reduce_pass_does_not_wait_for_it(
    tmp_path,
) -> None:
    base_dir, task_dirs, _, _ = build_model_set(tmp_path, kind="qwen2")
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS, str(base_dir), *map(str, task_dirs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "False", "True", "None", "True", "True"]


def test_the_preload_probes_what_the_kernels_views_probe() -> None:
    from ram_dist import kernels
    from ram_dist.engine import preload

    if not kernels.available():
        pytest.skip("numba is not installed")
    from ram_dist.kernels.views import torch_bf16_nan

    assert preload.bf16_nan() == torch_bf16_nan()
    assert preload.start() is preload.start()  # one thread per process


def test_the_workers_are_asked_for_while_the_checks_still_run(own_ray, monkeypatch) -> None:
    """In a process with no Ray (`own_ray`), so that `ray_session` starts an embedded one."""
    asked = threading.Event()
    warm = runtime.warm_workers

    def warm_and_say(slots: int) -> None:
        warm(slots)
        asked.set()

    monkeypatch.setattr(runtime, "warm_workers", warm_and_say)

    def checks() -> bool:  # ends only once the workers were asked for (or after a minute)
        return asked.wait(60)

    with runtime.ray_session(None, checks) as (cluster, asked_first):
        assert cluster.embedded
        assert asked_first
        assert ray.get(_preloaded.remote())
    assert not ray.is_initialized()


JOINING = """
import sys, ray
from ray.cluster_utils import Cluster
from ram_dist.engine import runtime
asked = []
warm = runtime.warm_workers
def warm_and_say(slots):
    warm(slots)
    asked.append(slots)
runtime.warm_workers = warm_and_say
head = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
try:
    checks = lambda: (ray.is_initialized(), list(asked))
    with runtime.ray_session(head.address, checks) as (cluster, (connected, seen)):
        print(cluster.embedded, cluster.cpus, connected, seen)
    print(ray.is_initialized())
    def refused():
        raise ValueError("a check refused the inputs")
    try:
        with runtime.ray_session(head.address, refused):
            print("not reached")
    except ValueError as e:
        print(e.args[0] == "a check refused the inputs", ray.is_initialized())
finally:
    head.shutdown()
"""


def test_on_a_running_ray_the_workers_are_asked_for_before_the_checks(own_ray) -> None:
    """A running Ray (`address`): connected and the workers asked for first, then the checks,
    whose imports would otherwise hold the GIL through the connection; a check that fails
    disconnects."""
    done = subprocess.run(
        [sys.executable, "-c", JOINING], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["False 2 True [2]", "False", "True False"]


def test_the_demo_makes_its_inputs_while_ray_starts(own_ray, monkeypatch, tmp_path) -> None:
    """`ram-dist demo` writes its inputs (torch imported to write them) in the thread that
    checks while Ray starts, not before Ray's start; the merge is the demo's."""
    from ram_dist.cli import demo

    made_in: list[str] = []
    make = demo.make_demo_inputs

    def make_and_say(folder: str) -> tuple[str, list[str]]:
        made_in.append(threading.current_thread().name)
        return make(folder)

    monkeypatch.setattr(demo, "make_demo_inputs", make_and_say)
    report = demo.run_demo(str(tmp_path / "demo"))
    assert made_in == ["ram-dist-checks"]
    assert report["method"] == "ram_plus"
    assert (tmp_path / "demo" / "merged" / "merge_report.json").is_file()
    assert not ray.is_initialized()


@ray.remote(num_cpus=1)
def _preloaded() -> bool:
    """Whether this worker imported the preload module (the kernels, numba's registries) as
    it started, before this task: an embedded Ray's workers do (`runtime.PRELOADED`)."""
    return "ram_dist.engine.worker_preload" in sys.modules and "numba" in sys.modules
