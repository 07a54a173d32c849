"""Run ``mergekit-yaml`` in this process and record what it read, for ``bench_merge.py``.

Usage::

    python benchmarks/mergekit_wrapper.py STATS.json -- CONFIG OUT [mergekit-yaml options]

Everything after ``--`` goes to mergekit's own ``mergekit-yaml`` console entry point, which
runs in this interpreter (no child process), so the wait4 figures the caller gets are
mergekit's own. At exit, whatever the outcome, ``STATS.json`` receives:

* ``proc_io_before``: ``/proc/self/io`` once mergekit is imported, just before the merge
  starts (imports alone read a lot: Python sources, shared libraries);
* ``proc_io``: ``/proc/self/io`` at exit, as a dict (``rchar`` = bytes returned by read-like system
  calls, ``read_bytes`` = bytes fetched from the block device). safetensors files are
  memory-mapped, so tensor data read through the mapping does NOT show in ``rchar``;
* ``tensor_bytes_loaded``: bytes of every tensor mergekit obtained from a safetensors file
  (counted by wrapping ``mergekit.io.loader.TensorLoader.get``), the application-level
  figure that corresponds to ram-dist's ``bytes_read``;
* ``children_io``: ``/proc/<pid>/io`` of child processes still alive at exit (mergekit on CPU
  starts none; listed so that one would not go unnoticed), and ``exit_code``.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

LOADED = {"bytes": 0, "tensors": 0}
IO_BEFORE: dict[str, int] = {}


class CountingLoader:
    """Wraps one safetensors handle and counts the bytes of the tensors taken from it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def get_tensor(self, key: str) -> Any:
        tensor = self._inner.get_tensor(key)
        LOADED["bytes"] += tensor.numel() * tensor.element_size()
        LOADED["tensors"] += 1
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def instrument_loader() -> None:
    """Make every shard handle mergekit opens a ``CountingLoader``."""
    from mergekit.io import loader

    original = loader.TensorLoader.get.__func__

    def get(cls: type, *args: Any, **kwargs: Any) -> CountingLoader:
        return CountingLoader(original(cls, *args, **kwargs))

    loader.TensorLoader.get = classmethod(get)


def read_io(pid: int | str) -> dict[str, int]:
    """``/proc/<pid>/io`` as integers (empty if the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def live_children() -> list[str]:
    pids: list[str] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += (task / "children").read_text().split()
        except OSError:
            continue
    return pids


def run_mergekit(args: list[str]) -> int:
    """Call the ``mergekit-yaml`` entry point as its script would; return its exit code."""
    (ep,) = entry_points(group="console_scripts", name="mergekit-yaml")
    main = ep.load()
    IO_BEFORE.update(read_io("self"))
    sys.argv = ["mergekit-yaml", *args]
    try:
        main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    stats_path, args = Path(sys.argv[1]), sys.argv[3:]
    code = 1
    try:
        instrument_loader()
        code = run_mergekit(args)
    finally:
        stats = {
            "exit_code": code,
            "proc_io_before": IO_BEFORE,
            "proc_io": read_io("self"),
            "tensor_bytes_loaded": LOADED["bytes"],
            "tensors_loaded": LOADED["tensors"],
            "children_io": {pid: read_io(pid) for pid in live_children()},
            "pid": os.getpid(),
        }
        stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
