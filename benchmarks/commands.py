"""What the benchmarks run: the configurations of `bench_merge` and the command line of each
(ram-dist's flags and mergekit's YAML with the same parameters), and the `ram-dist` command
itself."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.inputs import model_names

RAMDIST_METHODS = ("ram_plus", "ram", "ties", "ram_plus_soft", "ramplus_tl")
MERGEKIT_METHODS = ("ram", "ramplus_tl", "ties")
DEFAULT_RUNS = (
    "floor,ramdist:ram_plus,ramdist:ram,ramdist:ties,mergekit:ram,mergekit:ramplus_tl,mergekit:ties"
)
#: Runs mergekit in its own process and records what it read; a script, run by its path.
WRAPPER = Path(__file__).resolve().parent / "mergekit_wrapper.py"


def cli_command(cli: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The `ram-dist` command and its environment: `cli` (split as a shell would) if given,
    else the `ram-dist` executable beside this Python, else `python -m ram_dist.cli` with the
    `ram_dist` this process imports put first on `PYTHONPATH` (the command runs elsewhere)."""
    env = dict(os.environ)
    if cli:
        return shlex.split(cli), env
    exe = shutil.which(
        "ram-dist", path=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    )
    if exe:
        return [exe], env
    import ram_dist

    root = str(Path(ram_dist.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "ram_dist.cli"], env


@dataclass(frozen=True)
class Run:
    """One configuration to measure: ``floor``, ``ramdist:METHOD`` or ``mergekit:METHOD``."""

    tool: str
    method: str = ""

    @property
    def name(self) -> str:
        return f"{self.tool}:{self.method}" if self.method else self.tool

    @property
    def slug(self) -> str:
        """The name as a file name part."""
        return self.name.replace(":", "-")


def parse_runs(text: str) -> list[Run]:
    """``floor,ramdist:ram,...`` as Runs; ``none`` (or nothing) for no comparison at all."""
    allowed = {
        "floor": ("",),
        "ramdist": RAMDIST_METHODS,
        "previous": RAMDIST_METHODS,
        "mergekit": MERGEKIT_METHODS,
    }
    runs: list[Run] = []
    for item in (s.strip() for s in text.split(",")):
        if item in ("", "none"):
            continue
        tool, _, method = item.partition(":")
        if tool not in allowed or method not in allowed[tool]:
            raise SystemExit(
                f"--runs: unknown configuration {item!r}; valid: floor, "
                f"ramdist:{{{','.join(RAMDIST_METHODS)}}} (previous:... with --previous-cli), "
                f"mergekit:{{{','.join(MERGEKIT_METHODS)}}}"
            )
        if Run(tool, method) in runs:
            raise SystemExit(f"--runs lists {item} twice")
        runs.append(Run(tool, method))
    return runs


@dataclass(frozen=True)
class MethodParams:
    """Merge parameters given to both tools, so that their runs compute the same thing."""

    r: float
    alpha: float
    eps: float
    density: float
    weight: float


def ramdist_method_args(method: str, p: MethodParams) -> list[str]:
    """``ram-dist merge`` flags for ``method``: every parameter explicit, none left to defaults."""
    if method == "ties":
        density, weight = repr(p.density), repr(p.weight)
        return ["--density", density, "--weight", weight, "--lambda", "1.0", "--normalize"]
    args = ["--eps", repr(p.eps)]
    if method != "ram":
        args += ["--r", repr(p.r), "--alpha", repr(p.alpha)]
    return args


def mergekit_config(method: str, p: MethodParams, models_dir: Path) -> dict[str, Any]:
    """mergekit's YAML for ``method``, matching ``ramdist_method_args``.

    ``dtype: float32`` because ram-dist computes in float32 (mergekit would otherwise compute
    in the inputs' bf16), ``out_dtype: bfloat16`` so that both write the base's dtype.
    """
    tasks = [str(models_dir / name) for name in model_names()[1:]]
    if method == "ties":
        models = [
            {"model": t, "parameters": {"weight": p.weight, "density": p.density}} for t in tasks
        ]
        params: dict[str, Any] = {"normalize": True, "lambda": 1.0}
    else:
        models = [{"model": t} for t in tasks]
        params = {"epsilon": p.eps}
        if method != "ram":
            params |= {"r": p.r, "alpha": p.alpha}
    return {
        "merge_method": method,
        "base_model": str(models_dir / "base"),
        "models": models,
        "parameters": params,
        "dtype": "float32",
        "out_dtype": "bfloat16",
    }


def mergekit_options(args: argparse.Namespace) -> list[str]:
    """The ``mergekit-yaml`` options of a fast CPU merge (see the README for why each)."""
    base = ["--lazy-unpickle", "--no-copy-tokenizer", "--out-shard-size", f"{args.shard_mb}M"]
    return base + ["--quiet"] + list(args.mergekit_arg)
