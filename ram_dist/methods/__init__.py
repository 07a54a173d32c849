"""Merge rules as pure functions of tensors, registered by name.

A method never does I/O and never touches Ray: a worker hands it one chunk of the base and
the same chunk of every task, and gets back statistics (reduce pass) or the merged chunk
(map pass). The same functions run in unit tests, on CPU workers and on GPU workers.
"""

from ram_dist.methods.registry import METHODS, MergeMethod, get_method

__all__ = ["METHODS", "MergeMethod", "get_method"]
