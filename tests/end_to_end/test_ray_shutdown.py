"""No process of the embedded Ray outlives `ram-dist merge` by more than a few seconds,
however the command ends: a success, a refusal of bad input (found while Ray was starting),
a failure during the passes, and a SIGTERM (a pod being stopped) in the middle of the job.
Every descendant of the command is recorded while it runs, by pid and start time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fork_hooks
import psutil
import pytest
from builders import build_model_set
from safetensors.torch import load_file, save_file

#: What "a few seconds" after the command has exited means here.
GRACE_S = 5.0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    base_dir, task_dirs, _, _ = build_model_set(root)
    return {"base": base_dir, "tasks": task_dirs, "root": root}


def _args(base: Path, tasks: list[Path], out: Path) -> list[str]:
    args = [sys.executable, "-m", "ram_dist.cli", "merge", "--base", str(base), "--out", str(out)]
    for t in tasks:
        args += ["--task", str(t)]
    return args


def _run(args: list[str], *, stop_when_ray_is_up: bool = False) -> tuple[int, str, set]:
    """Run the command, recording its descendants (pid, start time) until it exits; with
    `stop_when_ray_is_up`, SIGTERM it as soon as Ray's raylet is running (so while Ray is
    still starting, the hardest moment to leave nothing behind)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    me = psutil.Process(proc.pid)
    seen: set[tuple[int, float]] = set()
    signalled = False
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            children = me.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            try:
                seen.add((child.pid, child.create_time()))
                if stop_when_ray_is_up and not signalled and "raylet" in child.name():
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
            except psutil.Error:
                pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=60)
    if stop_when_ray_is_up:
        assert signalled, out.decode(errors="replace")
    return proc.returncode, out.decode(errors="replace"), seen


def _left(seen: set) -> list[str]:
    """The recorded processes still running (not reaped zombies), waiting up to GRACE_S."""
    deadline = time.monotonic() + GRACE_S
    while True:
        alive = []
        for pid, started in seen:
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {p.name()}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _ray_started(seen: set) -> None:
    """The run did start an embedded Ray (else the check below would prove nothing)."""
    assert len(seen) >= 3, f"only {len(seen)} descendant process(es): no Ray started?"


def test_after_a_success(models, tmp_path) -> None:
    """Also: no thread but the main one registers a pair of at-fork hooks while Ray starts
    (`support/fork_hooks.py`), which Python reports on stderr as "release unlocked lock"
    when a fork of `ray.init` falls between the pair's registration and its release."""
    out = tmp_path / "out"
    args = _args(models["base"], models["tasks"], out)
    args[1:3] = [str(Path(fork_hooks.__file__))]
    code, text, seen = _run(args)
    assert code == 0, text
    assert fork_hooks.MARK not in text, text
    assert (out / "model.safetensors").exists()
    _ray_started(seen)
    assert _left(seen) == []
    # The outcome is printed before Ray is torn down: nothing of Ray's after it.
    assert text.rstrip().splitlines()[-1].startswith(f"merged model written to {out}")


def test_after_a_refusal(models, tmp_path) -> None:
    """A task whose tensor has another shape than the base's: exit 2, naming file and
    tensor, nothing published; Ray had been starting meanwhile, and is gone too."""
    bad = tmp_path / "bad"
    bad.mkdir()
    src = models["tasks"][0]
    state = load_file(str(src / "model.safetensors"))
    name = next(n for n, t in state.items() if t.dim() == 2)
    state[name] = state[name][:-1].clone()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    code, text, seen = _run(_args(models["base"], [bad, *models["tasks"][1:]], out))
    assert code == 2, text
    assert name in text and "bad" in text
    assert not out.exists()
    _ray_started(seen)
    assert _left(seen) == []


def test_after_a_failure_in_the_passes(models, tmp_path) -> None:
    """The shard cannot be created (a folder is in the way of its partial file): the map
    pass fails after the reduce pass ran on Ray; exit 2 (the user must move the folder), one
    line saying so, no shard, no index."""
    out = tmp_path / "out"
    (out / "model.safetensors.ram-dist-partial").mkdir(parents=True)
    code, text, seen = _run([*_args(models["base"], models["tasks"], out), "--overwrite"])
    assert code == 2 and "a folder is in the way" in text, text
    assert "model.safetensors" in text
    assert not (out / "model.safetensors").exists()
    _ray_started(seen)
    assert _left(seen) == []


def test_after_sigterm_mid_job(models, tmp_path) -> None:
    out = tmp_path / "out"
    code, text, seen = _run(_args(models["base"], models["tasks"], out), stop_when_ray_is_up=True)
    # 130 and "interrupted" from the CLI's handler; 15 from the one `ray.init` has in place
    # while Ray starts (it exits the same way, through every cleanup).
    assert code in (130, 15), text
    assert code == 15 or "interrupted" in text
    assert not (out / "model.safetensors").exists()
    assert not (out / "merge_report.json").exists()
    _ray_started(seen)
    assert _left(seen) == []
