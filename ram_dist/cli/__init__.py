"""The `ram-dist` command, a layer over `ram_dist.api`: merge, plan, probe, verify; and demo.
Errors a user can act on are one line on stderr: exit status 2 for what the user must fix, 1
for a failure that may pass (`main`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import textwrap
import threading
import typing
from functools import partial
from typing import TYPE_CHECKING, Any

from ram_dist import __version__, settings
from ram_dist.errors import RamDistError
from ram_dist.methods.parameters import Parameter, check_flag, cli_parameters

# Imported where used: `--help` and `verify` load neither torch nor Ray, and a merge's stores
# (fsspec) load in the thread that checks while Ray starts, not before its start.
if TYPE_CHECKING:
    from ram_dist.planning.config import MergeConfig

log = logging.getLogger("ram_dist.cli")


class _Lines(argparse.HelpFormatter):
    """Help that keeps its line breaks (`--method`: one line per method), each line wrapped
    on its own, its continuation indented."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return [
            wrapped
            for line in text.splitlines()
            for wrapped in textwrap.wrap(" ".join(line.split()), width, subsequent_indent="  ")
        ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ram-dist",
        description="Exact, distributed Reinforced Agent Merging of safetensors checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"ram-dist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    merge = sub.add_parser(
        "merge", help="merge task checkpoints into one model", formatter_class=_Lines
    )
    _add_job_arguments(merge, "merge")
    merge.add_argument(
        "--dry-run", action="store_true", help="check and plan only (as `ram-dist plan`)"
    )

    plan = sub.add_parser(
        "plan",
        help="read headers only: check everything and print what a merge would do",
        formatter_class=_Lines,
    )
    _add_job_arguments(plan, "plan")

    probe = sub.add_parser(
        "probe",
        help="reduce pass only: print sparsity and overlap statistics",
        formatter_class=_Lines,
    )
    _add_job_arguments(probe, "probe")
    probe.add_argument(
        "--json",
        dest="json_path",
        help="also write the report to this file, and beside it STEM.figure2.png (density "
        "and overlap per task), STEM.layers.csv and STEM.layers.png (per layer)",
    )
    probe.add_argument(
        "--format",
        dest="output_format",
        choices=("text", "markdown"),
        default="text",
        help="what to print: a table, or a Markdown summary to paste into a report",
    )

    verify = sub.add_parser(
        "verify", help="re-hash every shard of a merged output against its manifest"
    )
    verify.add_argument("out", help="the output folder or URL of a merge")
    verify.add_argument("--storage-options", default=None, metavar="JSON")

    demo = sub.add_parser(
        "demo", help="generate a tiny base and three agents, merge them, print the statistics"
    )
    demo.add_argument("--dir", default="demo-out", help="folder for the demo (default demo-out)")
    demo.add_argument("--address", help="Ray cluster address (default: embedded local Ray)")
    return parser


def _add_job_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """The job's settings (`ram_dist.settings`) as flags, each method parameter among them
    after `--method`; each flag's default is None, so a config file's value stands."""
    p.add_argument("config", nargs="?", help="mergekit-style YAML config (instead of flags)")
    p.add_argument("out_positional", nargs="?", metavar="OUT", help=argparse.SUPPRESS)
    for s in settings.flagged(command):
        kwargs: dict[str, Any] = {"dest": s.name, "default": None, "help": s.help_text()}
        if s.type is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = s.meta.parse
            if s.meta.choices:
                kwargs["choices"] = s.meta.choices
            else:  # named after the flag, not the field (`--unit-mb UNIT_MB`)
                kwargs["metavar"] = (
                    s.meta.metavar or s.meta.flag.lstrip("-").replace("-", "_").upper()
                )
            if typing.get_origin(s.type) is tuple or s.meta.repeat or s.meta.spill:
                kwargs["action"] = "append"  # a list: the flag once per value
        p.add_argument(s.meta.flag, **kwargs)
        if s.name == "method":
            _add_parameter_flags(p)


def _add_parameter_flags(p: argparse.ArgumentParser) -> None:
    """One flag per method parameter that has one (`methods.parameters`), with its help."""
    for param, text in cli_parameters():
        kwargs: dict[str, Any] = {"dest": param.cli_dest, "default": None, "help": text}
        if param.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = param.kind
            if param.choices:
                kwargs["choices"] = param.choices
            if param.per_task:
                kwargs["action"] = "append"
        p.add_argument(param.cli_flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> MergeConfig:
    """The job the flags ask for, built by `api.build_job`, the builder every API call uses:
    the flags over the YAML file's settings, the file's over the defaults."""
    from ram_dist.api import build_job

    given: dict[str, Any] = {}
    for s in settings.flagged(args.command):
        value = getattr(args, s.name)
        if value is not None and s.meta.spill is not None:  # `--method` twice: a sweep's
            if len(value) > 1:
                given[s.meta.spill] = tuple(value)
            value = value[0]
        if value is not None and s.meta.convert is not None:
            value = s.meta.convert(value)
        given[s.name] = value
    positional = args.out_positional
    if positional is not None:
        if given.get("out") is not None and given["out"] != positional:
            raise RamDistError("give the output once: either --out or after CONFIG")
        given["out"] = positional
    return build_job(args.config, given, partial(_parameter_flags, args))


def _parameter_flags(
    args: argparse.Namespace, method: str, n_tasks: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The parameter flags given, as `method` reads them: (those set once, one mapping per
    task). A flag that `method` gives another meaning than its own is refused, naming the
    method's flag (`--eps` of della: `--della-epsilon`)."""
    once: dict[str, Any] = {}
    per_task = []
    for param, _ in cli_parameters():
        values = getattr(args, param.cli_dest)
        if values is None:
            continue
        check_flag(param.cli_flag, param.name, method)
        if param.per_task:
            per_task.append((param, values))
        else:
            once[param.name] = values
    return once, _per_task_flags(per_task, n_tasks)


def _per_task_flags(flags: list[tuple[Parameter, list[Any]]], n_tasks: int) -> list[dict[str, Any]]:
    """Per-task flags (`--weight`, `--density`) given once (for every task) or once per task."""
    out: list[dict[str, Any]] = [{} for _ in range(n_tasks)]
    for param, values in flags:
        if len(values) == 1:
            values = values * n_tasks
        if len(values) != n_tasks:
            raise RamDistError(
                f"{param.cli_flag} given {len(values)} times for {n_tasks} tasks: give it "
                "once, or once per --task"
            )
        for params, value in zip(out, values, strict=True):
            params[param.name] = value
    return out if any(out) else []


def main(argv: list[str] | None = None) -> int:
    """Run one command. An error the user can act on (bad input, a file the store refused or
    could not give, a full disk) ends it with one line on stderr and the error's exit status:
    2 for what the user must fix, 1 for a failure that may pass; its traceback is logged at
    debug level (logger `ram_dist`), never printed."""
    args = build_parser().parse_args(argv)
    with contextlib.ExitStack() as last:  # a Ray this command starts is stopped after it ends
        try:
            return _dispatch(args, last)
        except RamDistError as e:
            log.debug("the command failed", exc_info=True)
            print(f"ram-dist: error: {e}", file=sys.stderr)
            return e.exit_status
        except Exception as e:
            from ram_dist.io.failures import is_storage_failure, storage_error

            if not is_storage_failure(e):
                raise
            log.debug("the command failed", exc_info=True)
            error = storage_error(e, getattr(e, "filename", None), "read or write")
            print(f"ram-dist: error: {error}", file=sys.stderr)
            return error.exit_status
        except KeyboardInterrupt:
            print("ram-dist: interrupted; nothing more was published", file=sys.stderr)
            return 130
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def _stop_on_sigterm() -> None:
    """SIGTERM (a pod being stopped, a `timeout`) ends the command like Ctrl-C does, through
    every cleanup: the lease released, an embedded Ray stopped, nothing published."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def _dispatch(args: argparse.Namespace, last: contextlib.ExitStack) -> int:
    from ram_dist import api

    if args.command == "verify":
        from ram_dist.io.storage import parse_storage_options

        options = parse_storage_options(args.storage_options)
        result = api.verify(args.out, storage_options=options)
        for problem in result.problems:
            print(f"ram-dist verify: {problem}", file=sys.stderr)
        if not result.ok:
            print(f"{args.out}: {len(result.problems)} problem(s)", file=sys.stderr)
            return 1
        print(f"{args.out}: {result.shards_checked} shard(s) match the manifest; index consistent")
        return 0
    from ram_dist.engine.runtime import ray_stopped_last
    from ram_dist.report.text import format_merge, format_plan, format_report

    last.enter_context(ray_stopped_last())
    _stop_on_sigterm()
    if args.command == "demo":
        from ram_dist.cli.demo import run_demo

        run_demo(args.dir, address=args.address)
        return 0

    if args.command == "probe" and args.out_positional is not None:
        raise RamDistError("probe writes no model: give no output location")
    # The job is built from the flags (torch and all imported, the inputs checked) in the
    # thread that runs while Ray starts.
    build = partial(config_from_args, args)
    if args.command == "plan" or getattr(args, "dry_run", False):
        planned = api.run_plan(build)
        if planned.config.log_format == "json":
            print(json.dumps(planned.data, indent=2, default=str))
        else:
            print(format_plan(planned.data))
        return 0
    if args.command == "probe":
        report = api.run_probe(build, address=args.address, json_path=args.json_path)
        if args.output_format == "markdown":
            from ram_dist.report.figures import markdown_summary

            print(markdown_summary(report.data))
        else:
            print(format_report(report.data))
        return 0
    merged = api.run_merge(build, address=args.address)
    if merged.config.sweeps:
        from ram_dist.report.text import format_sweep

        print(format_sweep(dict(merged.data)))
        return 0
    print(format_merge(merged.data, merged.config.out))
    return 0


def run() -> None:
    """The `ram-dist` executable: `main`, then exit at once. Everything the command wrote is
    closed and an embedded Ray is stopped by then; tearing down torch's, numba's and Ray's
    modules one by one at interpreter exit costs about a second for nothing."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
