"""What a job writes of its configuration: `mergekit_config.yml` (what
`mergekit_config.writing` writes, from the job), and the `quantization_config` the output's
`config.json` keeps where only part of a quantized base is written quantized again."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ram_dist.mergekit_config.writing import effective_config
from ram_dist.mergekit_config.writing import render as render_config
from ram_dist.planning import compressed as ct
from ram_dist.planning.job import Job
from ram_dist.planning.packed_sources import PackedIntSource

__all__ = ["fp8_groups_only", "quantization_left", "render"]


def render(job: Job) -> str:
    """The file's text: the job's method, inputs and per-tensor parameters, resolved; an
    adapter task written `BASE+ADAPTER`, as mergekit reads it."""
    base = job.config.base
    tasks = [  # an adapter as mergekit names it: the base with the adapter applied
        f"{base}+{url}" if ckpt.adapter is not None else url
        for url, ckpt in zip(job.config.tasks, job.tasks, strict=True)
    ]
    config = effective_config(job.method.name, base, tasks, job.params, job.config.out_dtype)
    return render_config(config, job.config.notes)


def quantization_left(job: Job) -> dict[str, Any] | None:
    """The output `config.json`'s `quantization_config` for a compressed-tensors base that
    mixes packed INT weights, written in bfloat16, with FP8 ones written FP8 again
    (`fp8_groups_only`); None where the base's is kept as it is (FP8 only, or no
    compressed-tensors) or dropped (`Layout.config_dtype`: nothing is written quantized)."""
    quant = job.base.quantization
    if job.config.out_dtype is not None or not quant or quant.get("quant_method") != ct.COMPRESSED:
        return None
    entries = job.layout.tensors.values()
    if not any(e.fp8_out is not None for e in entries):
        return None
    unpacked = [
        e.name.removesuffix("." + ct.WEIGHT)
        for e in entries
        if isinstance(e.sources[0], PackedIntSource)
    ]
    return fp8_groups_only(quant, unpacked) if unpacked else None


def fp8_groups_only(quant: Mapping[str, Any], unpacked: Sequence[str]) -> dict[str, Any]:
    """compressed-tensors' `quantization_config` `quant` describing only what is left
    quantized once the modules `unpacked` (their packed INT weights) are written in
    bfloat16: its `pack-quantized` groups dropped, its `format` the one left (no longer
    `mixed-precision`), and each of those modules that a group left may target added to
    `ignore`, so that a loader does not take its bfloat16 weight for an FP8 one. A target is
    matched as compressed-tensors matches it: `re:` a regex from the start of the module's
    name, else the name itself, or a module class, which the headers do not say: a target
    without a dot is taken to match."""
    out = copy.deepcopy(dict(quant))
    default = quant.get("format")
    groups = {
        name: group
        for name, group in (quant.get("config_groups") or {}).items()
        if (group.get("format") or default) != ct.PACKED
    }
    out["config_groups"] = groups
    formats = {group.get("format") or default for group in groups.values()}
    if len(formats) == 1:
        out["format"] = formats.pop()
    targets = [t for group in groups.values() for t in group.get("targets") or ()]
    ignore = list(quant.get("ignore") or ())
    for module in unpacked:
        if _targets(targets, module, classes=True) and not _targets(ignore, module):
            ignore.append(module)
    out["ignore"] = ignore
    return out


def _targets(targets: Sequence[str], module: str, classes: bool = False) -> bool:
    """Whether one of `targets` matches `module` by name (or, with `classes`, may by class)."""
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], module):
                return True
        elif t == module or (classes and "." not in t):
            return True
    return False
