"""Merge rules as pure functions of tensors, listed by name.

A method never does I/O and never touches Ray: a worker hands it one chunk of the base and
the same chunk of every task, and gets back statistics (reduce pass) or the merged chunk
(map pass). The same functions run in unit tests, on CPU workers and on GPU workers.

`METHODS` (`methods.registry`) is the one table of methods; what the engine needs of one is
the `MergeMethod` protocol (`methods.protocol`). No module of this package imports torch
when it is imported (each imports it where it computes), so `ram-dist --help` and the YAML
reader use the table without torch.
"""

from __future__ import annotations

from ram_dist.methods.protocol import MergeMethod
from ram_dist.methods.registry import METHODS, get_method

__all__ = ["METHODS", "MergeMethod", "get_method"]
