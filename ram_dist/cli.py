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
import threading
from functools import partial
from typing import TYPE_CHECKING, Any

from ram_dist import __version__
from ram_dist.errors import RamDistError
from ram_dist.io.failures import is_storage_failure, storage_error
from ram_dist.io.range_cache import MODES as CACHE_MODES
from ram_dist.io.storage import parse_storage_options
from ram_dist.methods import parameters as method_parameters
from ram_dist.methods.parameters import cli_parameters
from ram_dist.planning.devices import DEVICES
from ram_dist.planning.sizing import MAX_UNIT_BUDGET

if TYPE_CHECKING:  # imported where used: `--help` and `verify` load neither torch nor Ray
    from ram_dist.config import MergeConfig

log = logging.getLogger("ram_dist.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ram-dist",
        description="Exact, distributed Reinforced Agent Merging of safetensors checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"ram-dist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    merge = sub.add_parser("merge", help="merge task checkpoints into one model")
    _add_job_arguments(merge)
    merge.add_argument("--out", help="output folder (or give it after CONFIG)")
    merge.add_argument(
        "--overwrite", action="store_true", help="write into an output folder that holds files"
    )
    merge.add_argument(
        "--dry-run", action="store_true", help="check and plan only (as `ram-dist plan`)"
    )

    plan = sub.add_parser(
        "plan", help="read headers only: check everything and print what a merge would do"
    )
    _add_job_arguments(plan)
    plan.add_argument("--out", help="output folder (or give it after CONFIG)")
    for p in (merge, plan):
        p.add_argument(
            "--output-shared",
            action="store_true",
            help="the local output folder is mounted on every node: workers write their parts "
            "there (default: only on a one-node cluster; else the driver writes)",
        )

    probe = sub.add_parser("probe", help="reduce pass only: print sparsity and overlap statistics")
    _add_job_arguments(probe)
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


def _add_job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="mergekit-style YAML config (instead of flags)")
    p.add_argument("out_positional", nargs="?", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--base", help="base checkpoint folder the tasks were trained from")
    p.add_argument(
        "--task", action="append", default=None, help="task checkpoint folder (repeat, in order)"
    )
    p.add_argument(
        "--method",
        default=None,
        help=" | ".join(method_parameters.PARAMETERS) + " (default ram_plus)",
    )
    _add_parameter_flags(p)
    p.add_argument(
        "--out-dtype", default=None, help="dtype of merged tensors (default: the base's)"
    )
    p.add_argument(
        "--unit-mb",
        type=float,
        default=None,
        help="input MiB one work unit may read, per input (default: from the cluster's cores "
        f"and memory, at most {MAX_UNIT_BUDGET // 2**20})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="CPU tasks at once (default: one per CPU the GPU workers leave, as many queued)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="auto (default): every CPU with the fused kernels; the units of tensors that "
        "need the eager rule (dare_*, L1 rescaling, float64) on one worker per GPU, where the "
        "cluster has GPUs; cpu: every unit on the CPUs; cuda: every unit on the GPU workers, "
        "or refuse to start without GPUs",
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="merge inputs that hold NaN or Inf instead of refusing them",
    )
    p.add_argument(
        "--integers-from-base",
        action="store_true",
        help="copy the base's integer and bool tensors even where a task changed them (they "
        "cannot be merged; without it such a task is refused)",
    )
    p.add_argument(
        "--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else a local Ray)"
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "eager"),
        default="auto",
        help="auto: fused CPU kernels where they apply (the same bytes); eager: plain torch",
    )
    p.add_argument(
        "--input-cache",
        choices=CACHE_MODES,
        default="auto",
        help="keep what the first pass fetched on each node's disk, so later passes read it "
        "there: auto (inputs not on a local filesystem), on (every input), off",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="node-local folder for --input-cache (default: a private folder in the temp dir)",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text: a progress bar on a terminal; json: one JSON object per line on stderr",
    )
    p.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='fsspec options per protocol, e.g. \'{"s3": {"endpoint_url": "http://..."}}\'',
    )


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
    """Flags override the YAML file; the YAML file overrides the defaults."""
    from ram_dist.config import MergeConfig, load_yaml

    kwargs: dict[str, Any] = load_yaml(args.config) if args.config else {}
    if args.base is not None:
        kwargs["base"] = args.base
    if args.task:
        kwargs["tasks"] = tuple(args.task)
    if "base" not in kwargs:
        raise RamDistError("give a base checkpoint: --base PATH (or base_model in a config)")
    kwargs.setdefault("tasks", ())
    if args.method is not None:
        kwargs["method"] = args.method
    params = dict(kwargs.get("parameters", {}))
    for param, _ in cli_parameters():
        value = getattr(args, param.cli_dest)
        if not param.per_task and value is not None:
            params[param.name] = value
    kwargs["parameters"] = params
    per_task = _per_task_flags(args, len(kwargs["tasks"]))
    if per_task:
        base_params = kwargs.get("task_parameters") or [{} for _ in kwargs["tasks"]]
        kwargs["task_parameters"] = tuple(
            {**given, **flagged} for given, flagged in zip(base_params, per_task, strict=True)
        )
    if args.out_dtype is not None:
        kwargs["out_dtype"] = args.out_dtype
    if args.unit_mb is not None:
        if not args.unit_mb > 0:
            raise RamDistError(f"--unit-mb must be positive, got {args.unit_mb}")
        kwargs["unit_budget_bytes"] = max(1, int(args.unit_mb * 2**20))
    kwargs["workers"] = args.workers
    if args.device is not None:
        kwargs["device"] = args.device
    kwargs["allow_nonfinite"] = args.allow_nonfinite
    kwargs["integers_from_base"] = args.integers_from_base
    kwargs["log_format"] = args.log_format
    kwargs["kernels"] = args.kernels
    kwargs["input_cache"] = args.input_cache
    kwargs["cache_dir"] = args.cache_dir
    if args.storage_options is not None:
        kwargs["storage_options"] = parse_storage_options(args.storage_options)
    kwargs["address"] = args.address
    out = getattr(args, "out", None)
    if args.out_positional is not None:
        if out is not None and out != args.out_positional:
            raise RamDistError("give the output once: either --out or after CONFIG")
        out = args.out_positional
    if out is not None:
        kwargs["out"] = out
    if getattr(args, "overwrite", False):
        kwargs["overwrite"] = True
    if getattr(args, "output_shared", False):
        kwargs["output_shared"] = True
    return MergeConfig(**kwargs)


def _per_task_flags(args: argparse.Namespace, n_tasks: int) -> list[dict[str, Any]]:
    """Per-task flags (`--weight`, `--density`) given once (for every task) or once per task."""
    out: list[dict[str, Any]] = [{} for _ in range(n_tasks)]
    for param, _ in cli_parameters():
        values = getattr(args, param.cli_dest)
        if not param.per_task or not values:
            continue
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
        from ram_dist.demo import run_demo

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


if __name__ == "__main__":
    run()
