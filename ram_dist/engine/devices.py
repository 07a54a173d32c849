"""Which device the work units compute on, and how many run at once. Driver side, pure.

`--device auto` takes the GPUs where the cluster has them (one unit per GPU), else every CPU;
`cpu` takes every CPU, with the fused CPU kernels, even on a cluster with GPUs; `cuda` takes
the GPUs and refuses to start without any. The bytes are the same whichever runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ram_dist.errors import RamDistError

#: What `--device` (and the YAML key `device`) accepts.
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceChoice:
    """The device the units of a job run on, as decided for one cluster."""

    requested: str
    """What the job asked for: auto, cpu or cuda."""
    device: str
    """`cuda` (each unit asks Ray for one GPU) or `cpu`."""
    gpus: int
    """GPUs the units use: the cluster's on `cuda`, 0 on `cpu`."""
    slots: int
    """Units Ray runs at once by default: one per GPU, or one per CPU."""
    reason: str

    @property
    def uses_gpus(self) -> bool:
        return self.device == "cuda"

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "device": self.device,
            "gpus": self.gpus,
            "slots": self.slots,
            "reason": self.reason,
        }


def choose_device(requested: str, gpus: int, cpus: int) -> DeviceChoice:
    """The device for a cluster with `gpus` GPUs and `cpus` CPUs (Ray's resources). Raises
    `RamDistError` for `cuda` on a cluster without GPUs, or an unknown name."""
    if requested not in DEVICES:
        raise RamDistError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    cpus = max(1, cpus)
    has = f"the cluster has {gpus} GPU(s) and {cpus} CPU(s)"
    if requested == "cpu":
        unused = f"; its {gpus} GPU(s) stay idle" if gpus else ""
        return DeviceChoice(
            requested, "cpu", 0, cpus, f"--device cpu: one unit per CPU ({cpus}){unused}"
        )
    if gpus > 0:
        why = "--device cuda" if requested == "cuda" else f"auto: {has}"
        return DeviceChoice(requested, "cuda", gpus, gpus, f"{why}: one unit per GPU")
    if requested == "cuda":
        raise RamDistError(
            f"--device cuda, but the Ray cluster has no GPU ({cpus} CPU(s)): run on a cluster "
            "with GPUs, or use --device auto or cpu"
        )
    return DeviceChoice(requested, "cpu", 0, cpus, f"auto: {has}: one unit per CPU")
