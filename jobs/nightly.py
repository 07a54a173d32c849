"""A scheduled merge: write to OUT_ROOT/RUN_ID, then point OUT_ROOT/latest at it.

    python jobs/nightly.py CONFIG --out-root s3://bucket/merged [--run-id ID] [MERGE FLAGS...]

Runs where `ram-dist merge` runs (the Ray job's driver): the package comes from the image or
from `ray job submit --working-dir .`. RUN_ID is `--run-id`, else $RAM_DIST_RUN_ID, else today's
UTC date (YYYY-MM-DD). Every other flag means what it means to `ram-dist merge` (`--unit-mb
256`, `--storage-options JSON`, ...), read by its parser; the output location is this script's
to choose. The merge is ram-dist's Python API (`ram_dist.api.run_merge`), in this process.

- The merge runs on the same prefix every time, so ram-dist's own resume applies: a retried or
  re-triggered run finds the output complete and does nothing (exit 0), finds it partial (a
  killed run) and finishes it, reusing the shards already written, or finds that the config or
  an input changed since and refuses (exit 2), leaving `latest` where it was.
- `latest` is a small object holding the output URL and a newline. It is written only after
  the merge succeeded and its output is complete (merge_report.json, then the index or
  model.safetensors), and never moved from a later date to an earlier one (a backfill of a
  missed night leaves it alone).

Bucket options (endpoint, region) come from the config's `storage_options` or
`--storage-options`, exactly as for the merge; credentials from the environment.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ram_dist.api import run_merge
from ram_dist.cli import build_parser, config_from_args
from ram_dist.errors import RamDistError
from ram_dist.io.storage import Storage
from ram_dist.report.text import format_merge

REPORT_NAME = "merge_report.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
LATEST_NAME = "latest"
RUN_ID_ENV = "RAM_DIST_RUN_ID"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


def build_nightly_parser() -> argparse.ArgumentParser:
    """This script's own options; everything else is left for `ram-dist merge`."""
    parser = argparse.ArgumentParser(
        prog="nightly.py",
        description="Merge into OUT_ROOT/RUN_ID, then point OUT_ROOT/latest at it.",
        epilog="Other arguments (CONFIG, --unit-mb, --storage-options, ...) go to "
        "`ram-dist merge`.",
        allow_abbrev=False,  # `--out` must not pass for `--out-root`
    )
    parser.add_argument(
        "--out-root", required=True, help="prefix that holds one folder per run, and `latest`"
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help=f"name of this run's folder (default ${RUN_ID_ENV}, else today's UTC date)",
    )
    return parser


def split_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this script's options, the arguments for `ram-dist merge` without its output)."""
    return build_nightly_parser().parse_known_args(list(argv))


def run_id_of(given: str | None, now: dt.datetime | None = None) -> str:
    run_id = (
        given
        or os.environ.get(RUN_ID_ENV)
        or (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%d")
    )
    if not RUN_ID.match(run_id) or run_id == LATEST_NAME:
        raise RamDistError(
            f"run id {run_id!r} must be letters, digits, '.', '_' or '-' (and not {LATEST_NAME!r})"
        )
    return run_id


def merge_argv(merge_args: Sequence[str], out: str) -> list[str]:
    """`ram-dist merge` arguments for this run; the caller's must not name an output."""
    given = build_parser().parse_args(["merge", *merge_args])
    if given.out is not None or given.out_positional is not None:
        raise RamDistError("nightly.py chooses the output (OUT_ROOT/RUN_ID): give no --out")
    return ["merge", *merge_args, "--out", out]


def main(argv: Sequence[str] | None = None) -> int:
    ours, merge_args = split_args(sys.argv[1:] if argv is None else argv)
    try:
        return _run(ours, merge_args)
    except RamDistError as e:
        print(f"nightly.py: error: {e}", file=sys.stderr)
        return 2


def _run(ours: argparse.Namespace, merge_args: list[str]) -> int:
    run_id = run_id_of(ours.run_id)
    root = _location(ours.out_root)
    out = f"{root}/{run_id}"
    argv = merge_argv(merge_args, out)
    config = config_from_args(build_parser().parse_args(argv))  # checks the job before any work
    options: Mapping[str, Any] = config.storage_options
    fs, path = _fs(out, options)

    if _complete(fs, path):
        print(f"[nightly] {out} is already complete; ram-dist checks it against the inputs")
    print(f"[nightly] ram-dist {' '.join(_shown(argv))}", flush=True)
    try:
        report = run_merge(config)
    except RamDistError:
        print("[nightly] merge failed; latest not moved", flush=True)
        raise
    except KeyboardInterrupt:
        print("[nightly] interrupted; nothing more was published, latest not moved", flush=True)
        return 130
    print(format_merge(report.as_dict(), out), flush=True)
    fs.invalidate_cache()
    if not _complete(fs, path):
        print(f"[nightly] {out} is not complete after the merge; latest not moved", flush=True)
        return 1
    _publish_latest(root, out, run_id, options)
    return 0


def _shown(argv: list[str]) -> list[str]:
    """argv for the log: storage options may hold credentials, so their value is not shown."""
    return [
        "<hidden>" if i and argv[i - 1] == "--storage-options" else a for i, a in enumerate(argv)
    ]


def _location(url: str) -> str:
    """A URL without its trailing slash, or an absolute local path."""
    if "://" in url:
        return url.rstrip("/")
    return os.path.abspath(os.path.expanduser(url))


def _fs(url: str, options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem ram-dist itself uses for `url`, with the job's storage options."""
    return Storage(options).fs(url)


def _complete(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """The merge writes merge_report.json after every shard, and the index (if any) last."""
    return fs.exists(f"{path}/{REPORT_NAME}") and (
        fs.exists(f"{path}/{INDEX_NAME}") or fs.exists(f"{path}/{SINGLE_NAME}")
    )


def _publish_latest(root: str, out: str, run_id: str, options: Mapping[str, Any]) -> None:
    fs, path = _fs(f"{root}/{LATEST_NAME}", options)
    if fs.exists(path):
        current = fs.cat_file(path).decode("utf-8", "replace").strip()
        if current == out:
            print(f"[nightly] {root}/{LATEST_NAME} already names {out}", flush=True)
            return
        current_id = current.rsplit("/", 1)[-1]
        if ISO_DATE.match(current_id) and ISO_DATE.match(run_id) and current_id > run_id:
            print(
                f"[nightly] {root}/{LATEST_NAME} names a later run ({current}); left as it is",
                flush=True,
            )
            return
    data = (out + "\n").encode("utf-8")
    if isinstance(fs, LocalFileSystem):  # a rename, so a reader never sees half a pointer
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:  # one PUT: object stores show a whole object or none
        fs.pipe_file(path, data)
    print(f"[nightly] {root}/{LATEST_NAME} -> {out}", flush=True)


if __name__ == "__main__":
    # A stopped pod (SIGTERM) ends the merge as Ctrl-C does, through every cleanup: the lease
    # on the output released, unfinished uploads aborted, an embedded Ray stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
