"""Fused CPU kernels for the hot element-wise passes, compiled by numba (a dependency of
the package).

Import `ram_dist.kernels.ram_numba` only when `available()` (numba can be imported); where
it cannot, the eager torch methods run instead and give the same bytes. The eager path is
also the only one for float64 tensors and for what a kernel does not handle.

The kernels read and write numpy arrays of the stored elements (`READS`, `WRITES`: bfloat16
as its uint16 bits), so a CPU worker on the fused path never imports torch; torch tensors
are taken too, for tests and benchmarks. The kernels also read FP8, MXFP4 and packed
INT4/INT8 inputs as stored, decoding each value as they load it (`views.kernel_view`,
`primitives.load_span`), for every method that says so (`MergeMethod.reads_stored`).

The kernels are compiled once per signature and CPU, into numba's disk cache (see
`use_writable_cache`); `python -m ram_dist.kernels.warm` fills it ahead of the jobs. The
processes of a machine share the cache: one compiles a missing signature while the others
wait for it (`shared_cache`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ram_dist.dtypes import INFO


def _stored(dtypes: Sequence[str]) -> dict[str, type]:
    """Each safetensors dtype's numpy type of its stored elements (`ram_dist.dtypes.INFO`)."""
    return {d: np.dtype(INFO[d].numpy).type for d in dtypes}


#: The numpy array a kernel reads for each safetensors dtype it handles (float64 inputs are
#: computed in float64 by the spec: the eager path keeps them).
READS: dict[str, type] = _stored(("BF16", "F16", "F32"))
#: The numpy array a kernel writes for each output dtype it handles.
WRITES: dict[str, type] = {**READS, **_stored(("F64",))}


def available() -> bool:
    """Whether numba is installed, so that `ram_dist.kernels.ram_numba` can be imported."""
    return importlib.util.find_spec("numba") is not None


def numba_module(name: str) -> Any:
    """The numba kernel module `ram_dist.kernels.<name>` (imported, and compiled, on first
    use), or None where numba is not installed: the callers' numpy rules give the same
    bytes."""
    if name not in _MODULES:
        _MODULES[name] = (
            importlib.import_module(f"ram_dist.kernels.{name}") if available() else None
        )
    return _MODULES[name]


_MODULES: dict[str, Any] = {}


def handle(inputs: Sequence[str], out: str | None = None) -> bool:
    """Whether the kernels read these input dtypes (and write the output dtype)."""
    return all(d in READS for d in inputs) and (out is None or out in WRITES)


#: A warm-up call (`kernels.warm`): a kernel (a numba dispatcher), its signature's label, and
#: a call of the kernel's public wrapper on tiny inputs that compiles (or loads) that
#: signature. Declared here, where each kernel module's `warm_calls` names it without
#: importing `warm` (which imports the kernel modules).
Call = tuple[Any, str, Callable[[], Any]]


def _probe() -> None:
    """A function of this directory, for `use_writable_cache`'s question to numba."""


def use_writable_cache() -> None:
    """Give numba a cache directory it can write, before a kernel module is compiled.

    numba caches into `NUMBA_CACHE_DIR` when set, else `__pycache__` beside the kernel
    modules when writable (a checkout, or an install the user owns, as in the image), else
    its user-wide directory (`$XDG_CACHE_HOME/numba` or `~/.cache/numba`); later runs load
    from the same place. Where none is writable (a root-owned install run by a user whose
    HOME is read-only or missing, e.g. an arbitrary uid on Kubernetes), numba refuses to
    import the kernels at all; then cache in `<tempdir>/numba-cache-<uid>` (Ray needs a
    writable temp dir anyway), which later runs on the host reuse."""
    from numba.core import config
    from numba.core.caching import FunctionCache

    if config.CACHE_DIR:
        return
    try:
        FunctionCache(_probe)  # what `@njit(cache=True)` does when the module is imported
    except RuntimeError:  # "cannot cache function ...: no locator available"
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        config.CACHE_DIR = os.path.join(tempfile.gettempdir(), f"numba-cache-{uid}")
