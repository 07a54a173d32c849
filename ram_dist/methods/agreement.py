"""What `probe` counts beside RAM's overlap statistics: how the tasks' updates agree in sign
where they meet, and how large the updates a task makes alone are against those it shares.

Per chunk, from the same task vectors and change masks as RAM's counts (`ram._masks`):
- `pairs` int64[2, N, N]: [0][i][j] the elements both task i and task j changed, [1][i][j]
  those of them where the two updates have the same sign (the diagonal: each task's changes);
- `agree` int64[N]: a task's shared elements (two or more tasks changed them) where every
  other task that changed the element moved it the same way;
- `magnitude` int64[N, 2, EXPONENTS]: the exact sums (`float32_sum`) of |tau_t|, each value
  first rounded to float32, over the task's unique ([0]) and shared ([1]) elements.
All integers, so the totals are the same for any split, order, worker count or device.

`ProbeStatistics` wraps the counting RAM method so that the reduce pass gathers both; a merge
never runs it. On CPU where RAM's fused kernels apply, one kernel counts all of them in one
sweep (`kernels.agreement_numba`, the same integers); elsewhere (GPU, float64) the eager
rule (torch) here does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from ram_dist.methods.protocol import Defaults, MergeMethod, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: The keys of the summed statistics (never a tensor's name: `finalize` tells them apart by
#: the job's tensors).
KEYS = ("probe:pairs", "probe:agree", "probe:magnitude")


def agreement_statistics(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RAM's overlap counts of one chunk (`ram.overlap_statistics`), and the three statistics
    of the module's docstring, from one set of task vectors and masks."""
    import torch

    from ram_dist.methods.ram import _masks

    _, taus, masks, count = _masks(base, tasks, eps)
    n = len(tasks)
    up = [m & (tau > 0) for tau, m in zip(taus, masks, strict=True)]
    down = [m & (tau < 0) for tau, m in zip(taus, masks, strict=True)]
    pairs = torch.zeros((2, n, n), dtype=torch.int64)
    for i in range(n):
        pairs[:, i, i] = int(masks[i].sum())
        for j in range(i + 1, n):
            both = int((masks[i] & masks[j]).sum())
            same = int((up[i] & up[j]).sum()) + int((down[i] & down[j]).sum())
            pairs[:, i, j] = pairs[:, j, i] = torch.tensor([both, same])
    ups = sum((u.to(torch.int64) for u in up), torch.zeros_like(count))
    downs = count - ups
    shared = count >= 2
    agree = torch.tensor(
        [int((shared & ((up[t] & (downs == 0)) | (down[t] & (ups == 0)))).sum()) for t in range(n)],
        dtype=torch.int64,
    )
    magnitude = torch.zeros((n, 2, EXPONENTS), dtype=torch.int64, device=count.device)
    for t, (tau, m) in enumerate(zip(taus, masks, strict=True)):
        for k, where in enumerate((m & (count == 1), m & shared)):
            magnitude[t, k] = float32_sum(tau[where].abs())
    rows = [torch.bincount(count[m], minlength=n + 1) for m in masks]
    rows.append(torch.bincount(count.reshape(-1), minlength=n + 1))
    hist = torch.stack(rows).to(device="cpu", dtype=torch.int64)  # `ram.overlap_statistics`
    return hist, dict(zip(KEYS, (pairs, agree, magnitude.cpu()), strict=True))


#: Bins of `float32_sum`: one per float32 exponent.
EXPONENTS = 256


def float32_sum(values: torch.Tensor) -> torch.Tensor:
    """int64[EXPONENTS]: the exact sum of non-negative `values`, each first rounded to
    float32, as integers: a value `sig * 2**(max(E, 1) - 150)` (E its biased exponent, sig its
    24-bit significand) adds sig to bin E. `methods.exact_sums`'s scheme for the products of
    float32 values, narrowed to values that are float32 and never negative: 256 bins, each
    addend below 2**24, so a bin cannot overflow below 2**39 values. Inf lands in bin 255,
    which `float32_value` reads as inf (a probe refuses NaN inputs unless allowed)."""
    import torch

    bits = values.to(torch.float32).reshape(-1).view(torch.int32).to(torch.int64)
    exponent = bits >> 23
    sig = (bits & 0x7FFFFF) | ((exponent > 0).to(torch.int64) << 23)
    out = torch.zeros(EXPONENTS, dtype=torch.int64, device=values.device)
    return out.index_add_(0, exponent, sig)


def float32_value(bins: Any) -> Fraction | float:
    """The exact sum `float32_sum` stands for (inf where a value was inf or NaN)."""
    bins = [int(b) for b in bins]
    if bins[EXPONENTS - 1]:
        return math.inf
    return sum(
        (Fraction(b) * Fraction(2) ** (max(e, 1) - 150) for e, b in enumerate(bins) if b),
        Fraction(0),
    )


def summarize(totals: Mapping[str, Any], summary: Mapping[str, Any]) -> dict[str, Any]:
    """Per task and per pair, from the summed statistics and RAM's `summary` (its tasks'
    unique and shared counts): sign agreement and mean magnitudes, float64 from exact
    integers and exact sums (each rounded once)."""
    import numpy as np

    pairs = np.asarray(totals[KEYS[0]], dtype=np.int64)
    agree = np.asarray(totals[KEYS[1]], dtype=np.int64)
    magnitude = np.asarray(totals[KEYS[2]], dtype=np.int64)
    n = len(agree)
    tasks = []
    for t, ram in enumerate(summary["tasks"]):
        unique, shared = int(ram["unique"]), int(ram["shared"])
        sums = [float32_value(magnitude[t, k]) for k in (0, 1)]
        mean_unique = float(sums[0] / unique) if unique else None
        mean_shared = float(sums[1] / shared) if shared else None
        tasks.append(
            {
                "shared_agreeing": int(agree[t]),
                "sign_agreement": int(agree[t]) / shared if shared else None,
                "mean_abs_unique": mean_unique,
                "mean_abs_shared": mean_shared,
                "unique_to_shared_magnitude": float(sums[0] * shared / (sums[1] * unique))
                if unique and shared and sums[1]
                else None,
            }
        )
    pair_rows = [
        {
            "tasks": [i, j],
            "both_changed": int(pairs[0, i, j]),
            "same_sign": int(pairs[1, i, j]),
            "sign_agreement": int(pairs[1, i, j]) / int(pairs[0, i, j]) if pairs[0, i, j] else None,
        }
        for i in range(n)
        for j in range(i + 1, n)
    ]
    return {"tasks": tasks, "pairs": pair_rows}


@dataclass(frozen=True)
class ProbeStatistics(Defaults):
    """A RAM method (`inner`, whose statistics are `ram.overlap_statistics`) whose reduce
    pass also gathers `agreement_statistics`, from the same masks: what `probe` runs. Every
    other hook is the inner method's."""

    inner: MergeMethod

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def rounds(self) -> int:  # type: ignore[override]
        return self.inner.rounds

    @property
    def reports_overlap(self) -> bool:  # type: ignore[override]
        return True

    @property
    def parameters(self) -> tuple[Any, ...]:
        return self.inner.parameters

    def check(self, params: TensorParams, where: str) -> None:
        self.inner.check(params, where)

    def whole_rows(self, params: TensorParams) -> bool:
        return self.inner.whole_rows(params)

    def fuses(self, params: TensorParams) -> bool:
        return self.inner.fuses(params)

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        return self.inner.initial_state(params, numel, n_tasks)

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return self.inner.active(round_, state, tensor)

    @property
    def reads_stored(self) -> bool:
        return bool(getattr(self.inner, "reads_stored", False))

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], list[int] | None, np.ndarray | None]:
        """RAM's counts and the agreement statistics, and each input's NaN/Inf count and the
        precision check (where RAM's would run it: `precision.needs_check`), from one sweep
        of `kernels.agreement_numba`."""
        chunk, params, count_nonfinite = work.chunk, work.params, work.count_nonfinite
        from ram_dist.kernels import agreement_numba, precision
        from ram_dist.kernels.views import kernel_view

        base, *tasks = inputs
        dtypes = [precision.array_dtype(kernel_view(x, False)) for x in inputs]
        check = count_nonfinite and precision.needs_check(dtypes[0], dtypes[1:])
        hist, extra, counts, checks = agreement_numba.agreement_counts(
            base, tasks, params["epsilon"], count_nonfinite=count_nonfinite, check=check
        )
        return {chunk.tensor: hist, **dict(zip(KEYS, extra, strict=True))}, counts, checks

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        chunk, params = work.chunk, work.params
        hist, extra = agreement_statistics(base, tasks, params["epsilon"])
        return {chunk.tensor: hist, **extra}

    def finalize(self, end: RoundTotals) -> State:
        own = {k: v for k, v in end.totals.items() if k in KEYS}
        rest = {k: v for k, v in end.totals.items() if k not in KEYS}
        out = self.inner.finalize(replace(end, totals=rest))
        if len(own) == len(KEYS):
            return {**out, "agreement": summarize(own, out["summary"])}
        return out

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        raise NotImplementedError("probe statistics merge nothing")

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        return False

    def report(self, state: State) -> dict[str, Any]:
        out = self.inner.report(state)
        if "agreement" in state:
            out["agreement"] = state["agreement"]
        return out

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        return self.inner.report_lines(report)
