"""numba's disk cache shared by the processes of one machine: a kernel signature that is in no
cache yet is compiled by one process, while the others that need it wait for it and then load
it, instead of every Ray worker of a node compiling the same kernels at once.

numba looks a signature up in its cache (`load_overload`), compiles it on a miss, and saves it
(`save_overload`). `share_compiles` wraps each `cache=True` kernel's cache: after a miss, the
process takes a lock file of that kernel beside the cache entries (`flock`, so one per machine
or node: the cache directory is on the node's disk), looks again (another process may have
compiled it meanwhile), and keeps the lock until the signature is compiled and saved. A process
that holds the lock and dies releases it; one that waits more than `WAIT_S` compiles itself.
Where the cache directory cannot be written or `flock` is missing, numba's own behaviour is
unchanged.

Each kernel module ends with `share_compiles(globals())`. The compiles a process made are
counted per kernel (`take_compiled`): a pass's tasks report theirs (`kernels_compiled` in the
merge report).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: numba's own behaviour
    fcntl = None  # type: ignore[assignment]

#: How long a process waits for another process's compile of the same kernel before it
#: compiles the kernel itself (a compile takes seconds).
WAIT_S = 300.0
_POLL_S = 0.05

_COMPILED: Counter[str] = Counter()
_COUNT_LOCK = threading.Lock()


def take_compiled() -> dict[str, int]:
    """The kernel signatures this process compiled (per kernel, `module.function`) since the
    last call; cache hits are not counted."""
    with _COUNT_LOCK:
        taken = dict(_COMPILED)
        _COMPILED.clear()
    return taken


def share_compiles(namespace: dict[str, Any]) -> None:
    """Share the compiles of every `cache=True` kernel (numba dispatcher) in a kernel
    module's `namespace` with the other processes of the machine (see the module's doc)."""
    from numba.core.caching import FunctionCache
    from numba.core.dispatcher import Dispatcher

    for value in list(namespace.values()):
        if isinstance(value, Dispatcher) and isinstance(value._cache, FunctionCache):
            module = value.py_func.__module__.rsplit(".", 1)[-1]
            value._cache = SharedCache(value._cache, f"{module}.{value.__name__}")


def is_shared(kernel: Any) -> bool:
    """Whether a kernel's compiles are shared (`share_compiles`)."""
    return isinstance(getattr(kernel, "_cache", None), SharedCache)


class SharedCache:
    """A numba function cache whose misses are compiled by one process of the machine at a
    time: numba calls `load_overload`, then on a miss compiles and calls `save_overload`."""

    def __init__(self, cache: Any, name: str) -> None:
        self._cache = cache
        self.name = name
        self._held: int | None = None  # the lock file's descriptor, from miss to save

    def __getattr__(self, attribute: str) -> Any:  # cache_path, flush, enable, ...
        if attribute == "_cache":  # not set yet
            raise AttributeError(attribute)
        return getattr(self._cache, attribute)

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        self._release()  # a compile that failed since the last miss saved nothing
        found = self._cache.load_overload(sig, target_context)
        if found is not None:
            return found
        held = self._lock()
        if held is None:
            return None
        found = self._cache.load_overload(sig, target_context)  # compiled while we waited?
        if found is not None:
            os.close(held)
            return found
        self._held = held  # numba compiles now; `save_overload` releases
        return None

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            self._cache.save_overload(sig, data)
        finally:
            with _COUNT_LOCK:
                _COMPILED[self.name] += 1
            self._release()

    def _lock(self) -> int | None:
        """This kernel's lock file, locked: None where it cannot be (no `flock`, a cache
        directory that cannot be written) or after `WAIT_S`."""
        if fcntl is None:
            return None
        try:
            os.makedirs(self._cache.cache_path, exist_ok=True)
            path = os.path.join(self._cache.cache_path, f"{self.name}.compiling.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    return None
                time.sleep(_POLL_S)

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            with contextlib.suppress(OSError):
                os.close(held)  # closing the descriptor releases its flock
