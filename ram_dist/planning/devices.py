"""Where the work units compute, and how many run at once. Driver side, pure.

Merging is bound by storage, not arithmetic: the fused CPU kernels pass about 0.7 GB/s per
core, so the tensors they take are merged on the CPUs, every CPU, even on a cluster with
GPUs. The GPUs pay for the tensors that need the eager torch rule (TIES's and breadcrumbs'
L1 rescaling, float64, `--kernels eager`), and for LoRA tasks' products (r multiplies and
adds per element, in both passes: compute, not storage): with `--device auto` the units
holding one go to the GPU workers (one long-lived process per GPU, `engine.gpu`, where torch makes
the products: `kernels.lora.compute_on`), the others to the CPUs the GPU workers leave.
`cpu` runs every unit on the CPUs; `cuda` every unit on the GPUs, and refuses a cluster
without any. The bytes are the same wherever a unit runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ram_dist import kernels
from ram_dist.errors import RamDistError
from ram_dist.methods import MergeMethod
from ram_dist.methods.protocol import TensorParams
from ram_dist.planning.layout import Layout, TensorEntry
from ram_dist.planning.lora_sources import LoraSource
from ram_dist.planning.units import WorkUnit
from ram_dist.settings import DEVICES

#: Units a GPU worker runs at once, in threads of their own buffers: one reads while the
#: other computes. The memory plan counts each as a slot.
GPU_UNITS_AT_ONCE = 2


@dataclass(frozen=True)
class EagerTensors:
    """The merged tensors the fused CPU kernels do not take, and those a LoRA task's
    product is made for (with the new FP8 scales of such a weight, made from its merged
    bands): the tensors whose units go to the GPUs with `auto`; and why, in words (the
    first eager one's)."""

    names: frozenset[str]
    count: int
    """Merged tensors among `names` that need the eager rule (scales not counted)."""
    merged: int
    """Merged tensors in the job."""
    why: str
    products: int = 0
    """Merged tensors among `names` for their LoRA products only (scales not counted)."""


NO_EAGER = EagerTensors(frozenset(), 0, 0, "")


def eager_tensors(
    layout: Layout, params: Mapping[str, TensorParams], method: MergeMethod, kernels_on: bool
) -> EagerTensors:
    """Which merged tensors run the eager rule on a CPU, and why. `kernels_on`: the job's
    `--kernels` is `auto` (the kernels also need numba, asked here)."""
    names: set[str] = set()
    why = ""
    products: set[str] = set()
    for name, entry in layout.tensors.items():
        if not entry.participating:
            continue
        cause = _eager_cause(entry, params[name], method, kernels_on)
        product = not cause and any(isinstance(s, LoraSource) for s in entry.sources)
        if cause or product:
            names.add(name)
            if entry.fp8_out is not None:
                names.add(entry.fp8_out.scale_name)
            why = why or cause
            if product:
                products.add(name)
    count = sum(1 for n in names if layout.tensors[n].scale_of is None) - len(products)
    merged = sum(1 for e in layout.tensors.values() if e.participating)
    return EagerTensors(frozenset(names), count, merged, why, len(products))


def _eager_cause(
    entry: TensorEntry, params: TensorParams, method: MergeMethod, kernels_on: bool
) -> str:
    """Why a merged tensor runs the eager rule ("" when the fused kernels take it)."""
    if not kernels_on:
        return "--kernels eager"
    if not kernels.available():
        return "numba is not installed"
    read = [s.values_dtype for s in entry.sources]
    out = entry.merged_dtype
    if not kernels.handle(read, out):
        odd = sorted({d for d in read if d not in kernels.READS} or {out})
        return f"{', '.join(odd)} tensors"
    if not method.fuses(params):
        return f"{method.name} has no fused kernel for its parameters"
    return ""


@dataclass(frozen=True)
class DeviceChoice:
    """Where the units of a job run, as decided for one cluster."""

    requested: str
    """What the job asked for: auto, cpu or cuda."""
    device: str
    """`cpu` (every unit on the CPUs), `cuda` (every unit on the GPU workers), or
    `cpu+cuda` (units of tensors that need the eager rule on the GPUs, the rest on CPUs)."""
    gpus: int
    """GPU workers, one per GPU (0: the GPUs stay idle)."""
    cpu_slots: int
    """CPU tasks Ray runs at once: one per CPU the GPU workers leave (0: none run)."""
    reason: str
    eager: frozenset[str] = frozenset()
    """On `cpu+cuda`: the tensors whose units go to the GPUs."""

    @property
    def slots(self) -> int:
        """Units at once on the whole cluster (what the unit budget is planned for)."""
        return max(1, self.cpu_slots + GPU_UNITS_AT_ONCE * self.gpus)

    @property
    def uses_gpus(self) -> bool:
        return self.gpus > 0

    def on_gpu(self, units: Iterable[WorkUnit]) -> bool:
        """Whether the task of these units runs on a GPU worker."""
        if self.device != "cpu+cuda":
            return self.device == "cuda"
        return any(p.tensor in self.eager for u in units for p in u.pieces)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "device": self.device,
            "gpus": self.gpus,
            "cpu_slots": self.cpu_slots,
            "slots": self.slots,
            "reason": self.reason,
        }


def choose_device(
    requested: str, gpus: int, cpus: int, eager: EagerTensors = NO_EAGER
) -> DeviceChoice:
    """The devices for a cluster with `gpus` GPUs and `cpus` CPUs (Ray's resources), for a
    job whose `eager` tensors need the eager rule. Raises `RamDistError` for `cuda` on a
    cluster without GPUs, or an unknown name."""
    if requested not in DEVICES:
        raise RamDistError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    cpus = max(1, cpus)
    workers = f"one worker per GPU ({gpus}), {GPU_UNITS_AT_ONCE} units at a time each"
    if requested == "cpu":
        unused = f"; its {gpus} GPU(s) stay idle" if gpus else ""
        return DeviceChoice(
            requested, "cpu", 0, cpus, f"--device cpu: one unit per CPU ({cpus}){unused}"
        )
    if gpus == 0:
        if requested == "cuda":
            raise RamDistError(
                f"--device cuda, but the Ray cluster has no GPU ({cpus} CPU(s)): run on a "
                "cluster with GPUs, or use --device auto or cpu"
            )
        return DeviceChoice(requested, "cpu", 0, cpus, f"auto: no GPU: one unit per CPU ({cpus})")
    if requested == "cuda":
        why = f"--device cuda: every unit on the GPUs, {workers}"
        return DeviceChoice(requested, "cuda", gpus, 0, why)
    if not eager.names:
        return DeviceChoice(
            requested, "cpu", 0, cpus,
            f"auto: the fused CPU kernels take every merged tensor, and merging is bound by "
            f"storage: one unit per CPU ({cpus}); the {gpus} GPU(s) stay idle",
        )  # fmt: skip
    needs = []
    if eager.count:
        needs.append(f"{eager.count} of {eager.merged} merged tensors need the eager rule "
                     f"({eager.why})")  # fmt: skip
    if eager.products:
        needs.append(f"{eager.products} of {eager.merged} merged tensors have LoRA products "
                     "to compute")  # fmt: skip
    need = "; ".join(needs)
    left = cpus - gpus  # a GPU worker holds a CPU too
    every = eager.count + eager.products == eager.merged
    if every or left < 1:
        held = "" if every else f"; they hold the {cpus} CPU(s)"
        return DeviceChoice(
            requested, "cuda", gpus, 0, f"auto: {need}: every unit on the GPUs, {workers}{held}"
        )
    return DeviceChoice(
        requested, "cpu+cuda", gpus, left,
        f"auto: {need}: their units on the GPUs, {workers}; the other units on the other "
        f"{left} CPU(s), one each",
        eager.names,
    )  # fmt: skip


def job_device(
    requested: str,
    gpus: int,
    cpus: int,
    layout: Layout,
    params: Mapping[str, TensorParams],
    method: MergeMethod,
    kernels_setting: str,
) -> DeviceChoice:
    """`choose_device` for a job: the eager tensors asked only where the answer depends on
    them (`auto` on a cluster with GPUs)."""
    eager = NO_EAGER
    if requested == "auto" and gpus > 0:
        eager = eager_tensors(layout, params, method, kernels_setting == "auto")
    return choose_device(requested, gpus, cpus, eager)
