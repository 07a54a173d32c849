"""docs/extending.md's recipe for a kernel, carried out: a new module of `ram_dist/kernels/`
declares its warm-up in a function `warm_calls()` (one call of its public wrapper on tiny
inputs per signature), `python -m ram_dist.kernels.warm` collects it with no other file
changed, compiles it into numba's cache beside the module, and the count of signatures the
docs give no longer matches until they are updated."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from ram_dist import kernels
from ram_dist.kernels import shared_cache, warm

pytest.importorskip("numba")

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())

#: A kernel module as the page says to write one: a `@njit(cache=True)` kernel, its public
#: wrapper, and `warm_calls()` yielding (kernel, label, call) per signature.
MODULE = '''
from collections.abc import Iterator
from functools import partial

import numpy as np
from numba import njit

from ram_dist.kernels.shared_cache import share_compiles
from ram_dist.kernels.warm import N, Call


@njit(cache=True)
def _double(x, out):
    for i in range(x.size):
        out[i] = x[i] + x[i]


def double(x):
    out = np.empty_like(x)
    _double(x, out)
    return out


def warm_calls() -> Iterator[Call]:
    """One signature per width the wrapper is called with."""
    for dtype in (np.float32, np.float64):
        yield _double, np.dtype(dtype).name, partial(double, np.zeros(N, dtype))


share_compiles(globals())
'''


@pytest.fixture
def toy_kernel(tmp_path, monkeypatch):
    """`toy_numba.py` in a folder of the `ram_dist.kernels` package (as a file of
    `ram_dist/kernels/` would be), imported by name as `warm` imports the others."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "toy_numba.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.setattr(kernels, "__path__", [*kernels.__path__, str(folder)])
    yield folder
    sys.modules.pop("ram_dist.kernels.toy_numba", None)
    if hasattr(kernels, "toy_numba"):  # set by the import: gone with the module
        delattr(kernels, "toy_numba")


def test_a_new_kernel_module_is_warmed_with_no_other_change(toy_kernel, capsys):
    before = sum(1 for _ in warm.calls())
    assert "toy_numba._double" in warm.dispatchers()
    assert shared_cache.is_shared(warm.dispatchers()["toy_numba._double"])
    toy = [
        label for kernel, label, _ in warm.calls() if warm.name_of(kernel) == "toy_numba._double"
    ]
    assert toy == ["float32", "float64"]
    assert warm.main([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^toy_numba\._double\s+2 compiled\s+0 loaded", out, re.M), out
    assert "0 failed" in out
    assert list((toy_kernel / "__pycache__").glob("toy_numba._double-*.nbi"))
    # The count the docs give is the collected calls' (tests/kernels/test_kernel_cache.py):
    # it is now two short, as the page says a new signature makes it.
    text = (ROOT / "docs" / "architecture.md").read_text()
    documented = int(re.search(r"(\d+) signatures", text).group(1))  # type: ignore[union-attr]
    assert before == documented + 2


def test_the_page_says_the_recipe():
    text = " ".join((ROOT / "docs" / "extending.md").read_text().split())
    assert "A kernel module declares its own warm-up in a function `warm_calls()`" in text
    assert "python -m ram_dist.kernels.warm` collects them from every module of `kernels/`" in text
    assert "`tests/kernels/test_kernel_recipe.py` carries this out" in text
