"""Shared fixtures: one real local Ray per test module that asks for it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

# The test helpers (builders, reference) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A real two-CPU Ray for this module, shut down after it."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
