"""Which tasks the merge measures against the base at another precision than the base's own
(`kernels.precision`: a bfloat16 or float16 task of a float32, float64 or FP8 base, or of a
base in the other 16-bit dtype), said in words for `plan`, `probe`, the report and the model
card: "task 2: bfloat16, measured against the FP8 base rounded to bfloat16 (12 tensors)"."""

from __future__ import annotations

from collections.abc import Sequence

from ram_dist.dtypes import dtype_name
from ram_dist.kernels import precision
from ram_dist.planning.layout import Layout
from ram_dist.planning.packed_sources import PackedIntSource
from ram_dist.planning.sources import BaseValues, Fp8Source, Mxfp4Source, TensorSource


def measured_against(layout: Layout, labels: Sequence[str]) -> list[str]:
    """One sentence per task and precision for the merged tensors whose task is measured
    against the base rounded to the task's dtype (`labels`: the tasks', in order)."""
    found: dict[tuple[int, str, str], int] = {}
    for entry in layout.tensors.values():
        if not entry.participating or entry.scale_of is not None:
            continue
        base = entry.sources[0]
        for t, src in enumerate(entry.sources[1:]):
            if not isinstance(src, BaseValues) and precision.narrows(
                base.values_dtype, src.values_dtype
            ):
                key = (t, src.values_dtype, _stored(base))
                found[key] = found.get(key, 0) + 1
    return [
        f"{labels[t]}: {dtype_name(dtype)}, measured against the {base} base rounded to "
        f"{dtype_name(dtype)} ({n} tensor{'s' if n != 1 else ''})"
        for (t, dtype, base), n in sorted(found.items())
    ]


def _stored(base: TensorSource) -> str:
    """How the base stores a tensor, in a word: FP8, MXFP4, or its dtype's name."""
    if isinstance(base, Fp8Source):
        return "FP8"
    if isinstance(base, PackedIntSource):
        return f"INT{base.bits}"
    return "MXFP4" if isinstance(base, Mxfp4Source) else dtype_name(base.values_dtype)


def checked_tensors(layout: Layout) -> int:
    """The merged tensors whose changes the first reduce round's precision check counts
    (`kernels.precision.counts_rounding`: the base holds more than 16 bits)."""
    return sum(
        1
        for e in layout.tensors.values()
        if e.participating
        and e.scale_of is None
        and precision.counts_rounding(e.sources[0].values_dtype)
    )
