"""What the precision check says of each task (`report["precision"]`): the share of its
changes that are only the base rounded to bfloat16 or float16, and a one-line warning where
that share is above `WARN_SHARE`.

The rule measures each task against the base at the task's own precision, so a bfloat16 agent
of an FP8 or float32 base shows none of that rounding. What no rule can see is a pipeline that
rounds somewhere else: an agent trained in bfloat16 and saved in float32, or loaded in float16
and saved back. Its untouched elements are then exactly the base rounded to a 16-bit dtype,
which a genuine update almost never is (a real bfloat16 update of one unit in the last place
is measured from the rounded base, so it is not one). Counting that equality, rather than
changes of at most an ulp, warns on such pipelines and not on healthy bfloat16 agents, whose
updates are often a single ulp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Above this share of a task's changes being rounding, `probe` and `merge` warn.
WARN_SHARE = 0.1


def precision_report(
    changed: Sequence[int], rounding: Sequence[int], models: Sequence[str], tensors_checked: int
) -> dict[str, Any]:
    """The report's `precision` key from the summed counts (per task, in task order)."""
    tasks = []
    warnings = []
    for i, (moved, rounded, model) in enumerate(zip(changed, rounding, models, strict=True), 1):
        share = rounded / moved if moved else None
        tasks.append(
            {"task": i, "model": model, "changed": moved, "rounding": rounded,
             "rounding_share": share}
        )  # fmt: skip
        if share is not None and share > WARN_SHARE:
            warnings.append(warning(i, model, moved, share))
    return {
        "tensors_checked": tensors_checked,
        "warn_share": WARN_SHARE,
        "tasks": tasks,
        "warnings": warnings,
    }


def warning(task: int, model: str, changed: int, share: float) -> str:
    """The one-line warning of a task whose changes are mostly the base rounded."""
    return (
        f"warning: task {task} ({model}): {share:.0%} of the {changed} elements it changed "
        "(where the base holds more than 16 bits) are only the base rounded to bfloat16 or "
        "float16, so the merge sees rounding there, not training; likely cause: the task was "
        "saved at another precision than the base it was trained from, or went through a "
        "round trip in float16"
    )


def precision_lines(report: dict[str, Any]) -> list[str]:
    """The tasks measured against the base at another precision, and the warnings, as the
    text reports print them."""
    against = (report.get("formats") or {}).get("measured_against") or []
    lines = [f"  {sentence}" for sentence in against]
    if lines:
        lines.insert(0, "measured against the base at the task's precision:")
    return lines + list((report.get("precision") or {}).get("warnings") or [])
