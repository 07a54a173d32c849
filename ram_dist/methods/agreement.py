"""What `probe` counts beside RAM's overlap statistics: how the tasks' updates agree in sign
where they meet, and how large the updates a task makes alone are against those it shares.

Per chunk, from the same task vectors and change masks as RAM's counts (`ram._masks`):
- `pairs` int64[2, N, N]: [0][i][j] the elements both task i and task j changed, [1][i][j]
  those of them where the two updates have the same sign (the diagonal: each task's changes);
- `agree` int64[N]: a task's shared elements (two or more tasks changed them) where every
  other task that changed the element moved it the same way;
- `magnitude` int64[N, 2, BINS]: the exact sums (`exact_sums.product_sum`) of |tau_t|, each
  value first rounded to float32, over the task's unique ([0]) and shared ([1]) elements.
All integers, so the totals are the same for any split, order, worker count or device.

`ProbeStatistics` wraps the counting RAM method so that the reduce pass gathers both; a merge
never runs it. It takes the eager rule (torch) for every chunk: the fused kernels count
RAM's histogram only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.methods import exact_sums
from ram_dist.methods.protocol import Chunk, Defaults, MergeMethod, State, TensorParams

if TYPE_CHECKING:
    import torch

#: The keys of the summed statistics (never a tensor's name: `finalize` tells them apart by
#: the job's tensors).
KEYS = ("probe:pairs", "probe:agree", "probe:magnitude")


def agreement_statistics(
    base: torch.Tensor, tasks: list[torch.Tensor], eps: float
) -> dict[str, torch.Tensor]:
    """The three statistics of one chunk (see the module's docstring)."""
    import torch

    from ram_dist.methods.ram import _masks

    _, taus, masks, count = _masks(base, tasks, eps)
    n = len(tasks)
    up = [m & (tau > 0) for tau, m in zip(taus, masks, strict=True)]
    down = [m & (tau < 0) for tau, m in zip(taus, masks, strict=True)]
    pairs = torch.zeros((2, n, n), dtype=torch.int64)
    for i in range(n):
        for j in range(n):
            pairs[0, i, j] = int((masks[i] & masks[j]).sum())
            pairs[1, i, j] = int((up[i] & up[j]).sum() + (down[i] & down[j]).sum())
    ups = sum((u.to(torch.int64) for u in up), torch.zeros_like(count))
    downs = count - ups
    shared = count >= 2
    agree = torch.tensor(
        [int((shared & ((up[t] & (downs == 0)) | (down[t] & (ups == 0)))).sum()) for t in range(n)],
        dtype=torch.int64,
    )
    magnitude = torch.zeros((n, 2, exact_sums.BINS), dtype=torch.int64)
    for t, (tau, m) in enumerate(zip(taus, masks, strict=True)):
        size = tau.abs().to(torch.float32)
        ones = torch.ones_like(size)
        for k, where in enumerate((m & (count == 1), m & shared)):
            magnitude[t, k] = exact_sums.product_sum(torch.where(where, size, 0.0), ones).cpu()
    return dict(zip(KEYS, (pairs, agree, magnitude), strict=True))


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
        sums = [exact_sums.exact(magnitude[t, k]) for k in (0, 1)]
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
    """A RAM method (`inner`) whose reduce pass also gathers `agreement_statistics`: what
    `probe` runs. Every other hook is the inner method's."""

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

    def fused_statistics(self, *args: Any) -> None:
        """None: the eager rule counts both statistics from one set of task vectors."""
        return None

    def chunk_statistics(
        self,
        round_: int,
        chunk: Chunk,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: TensorParams,
        state: State,
    ) -> dict[str, torch.Tensor]:
        stats = self.inner.chunk_statistics(round_, chunk, base, tasks, params, state)
        return {**stats, **agreement_statistics(base, tasks, params["epsilon"])}

    def finalize(
        self,
        round_: int,
        totals: dict[str, torch.Tensor],
        params: Mapping[str, TensorParams],
        numel: Mapping[str, int],
        state: State,
    ) -> State:
        own = {k: v for k, v in totals.items() if k in KEYS}
        rest = {k: v for k, v in totals.items() if k not in KEYS}
        out = self.inner.finalize(round_, rest, params, numel, state)
        if len(own) == len(KEYS):
            return {**out, "agreement": summarize(own, out["summary"])}
        return out

    def merge_chunk(self, *args: Any) -> torch.Tensor:
        raise NotImplementedError("probe statistics merge nothing")

    def fused_merge(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def report(self, state: State) -> dict[str, Any]:
        out = self.inner.report(state)
        if "agreement" in state:
            out["agreement"] = state["agreement"]
        return out

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        return self.inner.report_lines(report)
