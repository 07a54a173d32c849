"""A `ram-dist` command that must be refused: exit 2, an error naming what is wrong, no
traceback, nothing published at the output."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def merge_argv(base, tasks, out, *extra) -> list[str]:  # noqa: ANN001
    """`ram-dist merge`'s arguments: `tasks` onto `base` into `out`, then `extra`."""
    argv = ["merge", "--base", str(base), "--out", str(out), *map(str, extra)]
    for t in tasks:
        argv += ["--task", str(t)]
    return argv


def command_refused(capsys, argv: list[str], out: Path, *fragments: str) -> str:  # noqa: ANN001
    """stderr from `ram-dist: error: ` on, after checking that `argv` exits 2, that the error
    holds each of `fragments`, that no traceback was printed and that no shard or index was
    written at `out`."""
    from ram_dist.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    err = err[err.index("ram-dist: error: ") :]  # Ray may log before it, on a closed stream
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    if out.exists():  # nothing published: no shard, no index
        names = os.listdir(out)
        assert not [n for n in names if n.endswith((".safetensors", "index.json"))], names
    return err


def merge_refused(capsys, base: Path, tasks: Sequence[Path], out: Path, *extra: str) -> str:  # noqa: ANN001
    """The error line (without `ram-dist: error: `) of `ram-dist merge` of `tasks` onto
    `base`, after checking exit 2, that no traceback was printed and that no shard or index
    was written at `out`."""
    from ram_dist.cli import main

    argv = ["merge", "--base", str(base), "--out", str(out), *extra]
    for t in tasks:
        argv += ["--task", str(t)]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    if out.exists():
        names = os.listdir(out)
        assert not [n for n in names if n.endswith((".safetensors", "index.json"))], names
    line = err[err.index("ram-dist: error: ") :].splitlines()[0]
    return line.removeprefix("ram-dist: error: ")
