"""What the driver needs only once its passes are under way, loaded in a thread of its own
from the checks on: torch (a reduce round's sums, `passes.reduce_pass`) and the bits torch
gives a NaN cast to bfloat16 (for the map pass's kernels, `passes.work_flags`; the kernels'
views load numba). Driver side.

Importing torch is about a second of CPU. In the checks' own thread (`runtime.ray_session`)
it held the checks back, and on a Ray that is already running the first tasks are sent only
once the checks end; after Ray's start it held back the first tasks' submission. Beside
them, it overlaps both. `start()` begins it (once per process); `bf16_nan()` and a later
`import torch` wait for it, Python's import lock making the second importer wait for the
first.
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _load() -> None:
    try:
        import torch  # noqa: F401

        from ram_dist import kernels

        if kernels.available():
            from ram_dist.kernels.views import torch_bf16_nan

            _STATE["bf16_nan"] = torch_bf16_nan()
    except BaseException as e:  # raised again by `bf16_nan`, in the thread that needs it
        _STATE["error"] = e


def start() -> threading.Thread:
    """Begin loading torch and probing its NaN bits in a daemon thread, unless begun."""
    with _LOCK:
        thread = _STATE.get("thread")
        if thread is None:
            thread = _STATE["thread"] = threading.Thread(
                target=_load, name="ram-dist-preload", daemon=True
            )
            thread.start()
        return thread


def bf16_nan() -> int:
    """The bits torch writes for a NaN cast to bfloat16 here (`kernels.views.torch_bf16_nan`),
    once the preload (begun now if it was not) has ended."""
    start().join()
    if "error" in _STATE:
        raise _STATE["error"]
    if "bf16_nan" not in _STATE:  # numba appeared since the preload ran, or was never there
        from ram_dist.kernels.views import torch_bf16_nan

        _STATE["bf16_nan"] = torch_bf16_nan()
    return int(_STATE["bf16_nan"])
