"""DELLA (`della`, `della_linear`): per task, drop each element of delta at random with a
keep probability that grows with its magnitude rank in its row, rescale the kept vector to
delta's L1 norm, then the weighted combine step (`della`: with TIES's sign election).

mergekit's rule (`sparsify.della_magprune`), per (tensor, task), in float32:

* Rows: a 1-D tensor is one row; otherwise ranks run along dimension 1 (for a 2-D tensor,
  within each row), so every row of the first dimension holds whole rank groups: the method
  asks for whole rows (`whole_rows`) and ranks inside the chunk.
* Ranks: |delta| ascending, 1..n in a group of n; ties (equal float32 magnitudes, which
  mergekit's unstable `argsort` orders arbitrarily) go to the lowest flat index first in
  descending order, so among equal magnitudes the lowest index has the highest rank.
* `rank_norm = float32(r - 1) / float32(n - 1)` (true division; mergekit's clamp to [0, 1]
  changes nothing, r <= n), then `p = float32(density - epsilon) + (rank_norm * 2) *
  float32(epsilon)`, op by op as torch evaluates mergekit's expression. A group of one
  element (mergekit fails on it: 0 / 0 is not a probability) takes `rank_norm = 0.5`, the
  middle of the band.
* Keep element i when its counter-based draw (DARE's generator, `rng.py`, keyed by (seed,
  task index, tensor name, flat index)) is below p: `bits * 2**-24 < p`, exact in float32.
  mergekit draws `torch.bernoulli(p)` from torch's global generator: masks agree in
  distribution only.
* density >= 1 leaves delta untouched (epsilon not read); density - epsilon must be > 0 and
  density + epsilon < 1 (`check`, before any work, as mergekit raises mid-merge).
* `rescale` (default true): mergekit's L1 rule over the whole tensor (`dare.rescale_factor`,
  exact integer L1 sums in one reduce round, so the factor may differ from mergekit's
  cascaded float32 sums by an ulp).

Every step is a rule of the element, its row and the tensor's two L1 sums: the bytes do not
depend on the unit budget, the worker count or the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.kernels import precision
from ram_dist.methods.generalized_task_arithmetic import combine, dare, rng, topk
from ram_dist.methods.parameters import (
    DELLA_EPSILON,
    DENSITY,
    INT8_MASK,
    LAMBDA,
    NORMALIZE,
    RESCALE,
    SEED,
    WEIGHT,
    Parameter,
    variant,
)
from ram_dist.methods.protocol import Chunk, Eager, MergekitRule, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals


def rank_groups(shape: Sequence[int]) -> tuple[int, int]:
    """(n, inner): a tensor's rank groups have n elements, `inner` apart in flat order; a
    row of the first dimension holds `inner` whole groups (a 1-D tensor: one group)."""
    if len(shape) < 2:
        return (math.prod(shape), 1)
    return (int(shape[1]), math.prod(shape[2:]))


def row_ranks(keys: torch.Tensor, n: int, inner: int) -> torch.Tensor:
    """int64 ascending ranks 1..n of a chunk's magnitude keys (whole rows, flat) in their
    groups; equal keys: the lowest flat index ranks highest."""
    import torch

    grouped = keys.reshape(-1, n, inner)
    order = torch.sort(grouped, dim=1, descending=True, stable=True).indices
    rank = torch.arange(n, 0, -1, dtype=torch.int64, device=keys.device).view(1, n, 1)
    out = torch.empty_like(grouped)
    out.scatter_(1, order, rank.expand_as(order))
    return out.reshape(-1)


def keep_probabilities(ranks: torch.Tensor, n: int, density: float, epsilon: float):
    """float32 keep probabilities from ascending ranks in groups of n, as mergekit computes
    them (see the module's docstring)."""
    import torch

    if n > 1:
        # mergekit: float32 ranks `argsort + 1`, minus the minimum 1, over `max - min`;
        # exact integers below 2**24, so `r - 1` is the rank less one (<= 1: no clamp).
        r = (ranks - 1).to(torch.float32)
        if n > 1 << 24:
            r = (r + 1) - 1
        top = torch.tensor(float(n), dtype=torch.float32, device=ranks.device)
        norm = r / (top - 1)
    else:
        norm = torch.full_like(ranks, 0.5, dtype=torch.float32)
    low = torch.tensor(density - epsilon, dtype=torch.float32, device=ranks.device)
    eps = torch.tensor(epsilon, dtype=torch.float32, device=ranks.device)
    return low + (norm * 2) * eps


def keep_mask(
    delta: torch.Tensor,
    shape: Sequence[int],
    *,
    seed: int,
    task: int,
    name: str,
    start: int,
    density: float,
    epsilon: float,
) -> torch.Tensor:
    """bool, one per element of a chunk of whole rows (flat index `start` first)."""
    import torch

    n, inner = rank_groups(shape)
    if delta.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=delta.device)
    if delta.numel() % (n * inner):
        raise ValueError(f"a chunk of {name} holds {delta.numel()} elements, not whole rows")
    ranks = row_ranks(topk.magnitude_keys(delta), n, inner)
    probs = keep_probabilities(ranks, n, density, epsilon)
    bits = rng.random_bits(seed, task, name, start, start + delta.numel(), delta.device)
    return rng.uniform(bits) < probs


def _check_band(density: float, epsilon: float, where: str, task: int) -> None:
    """mergekit's condition, in float64 as it evaluates it."""
    if density < 1 and (density + epsilon >= 1 or density - epsilon <= 0):
        raise RamDistError(
            f"{where}: parameter epsilon must keep density - epsilon > 0 and "
            f"density + epsilon < 1 (della's keep probabilities), got epsilon {epsilon} "
            f"with density {density} for task {task + 1}: use epsilon < "
            f"{min(density, 1 - density)}"
        )


@dataclass(frozen=True)
class Della(MergekitRule, Eager):
    """mergekit's `della` (`consensus=True`) and `della_linear` (`False`)."""

    name: str
    consensus: bool
    label: str = ""
    summary: str = ""
    reference: str = "Deep et al. 2024"
    reads_stored: bool = True
    """Its kernels (`della_numba`) read quantized inputs as stored."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """mergekit's: weight, density, epsilon per task; normalize (della: true), lambda,
        rescale (true); and DARE's seed (ram-dist's own)."""
        normalize = variant(NORMALIZE, self.consensus)
        return (
            WEIGHT, DENSITY, DELLA_EPSILON, normalize, LAMBDA, variant(RESCALE, True), SEED,
            INT8_MASK,
        )  # fmt: skip

    rounds = 1

    def whole_rows(self, params: TensorParams) -> bool:
        """Ranks run within rows: where a task is sparsified, a chunk holds whole rows of the
        first dimension (a 1-D tensor: all of it)."""
        return any(float(d) < 1 for d in params["density"])

    def check(self, params: TensorParams, where: str) -> None:
        """Each task's epsilon against its density (mergekit's band check)."""
        for t, (d, e) in enumerate(zip(params["density"], params["epsilon"], strict=True)):
            _check_band(float(d), float(e), where, t)

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        tensors = {
            name: {"rescale": bool(p["rescale"]) and any(float(d) < 1 for d in p["density"])}
            for name, p in params.items()
        }
        seed = next((p["seed"] for p in params.values()), 0)
        return {"tensors": tensors, "seed": seed}

    def active(self, round_: int, state: State, tensor: str) -> bool:
        info = state["tensors"].get(tensor)
        return bool(info and info["rescale"])

    def _masks(
        self, chunk: Chunk, deltas: Sequence[torch.Tensor], params: TensorParams
    ) -> list[torch.Tensor | None]:
        """Each task's keep mask of the chunk (None: density >= 1, untouched)."""
        masks: list[torch.Tensor | None] = []
        for t, (d, density, epsilon) in enumerate(
            zip(deltas, params["density"], params["epsilon"], strict=True)
        ):
            if float(density) >= 1:
                masks.append(None)
                continue
            masks.append(
                keep_mask(
                    d.reshape(-1),
                    chunk.shape,
                    seed=int(params["seed"]),
                    task=t,
                    name=chunk.tensor,
                    start=chunk.start,
                    density=float(density),
                    epsilon=float(epsilon),
                )  # fmt: skip
            )
        return masks

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """int64[N, 2, 256]: per task the L1 statistics of delta and of the kept delta."""
        chunk, params = work.chunk, work.params
        import torch

        _, deltas = combine.task_vectors(base, tasks)
        rows = []
        for d, keep in zip(deltas, self._masks(chunk, deltas, params), strict=True):
            if keep is None:
                rows.append(torch.zeros(2, dare.L1_BINS, dtype=torch.int64, device=d.device))
                continue
            kept = d.reshape(-1) * keep
            rows.append(torch.stack([dare.l1_statistic(d), dare.l1_statistic(kept)]))
        return {chunk.tensor: torch.stack(rows)}

    def finalize(self, end: RoundTotals) -> State:
        totals, params, state = end.totals, end.params, end.state
        for name, info in state["tensors"].items():
            if name in totals:
                densities = [float(d) for d in params[name]["density"]]
                info["factors"] = dare.rescale_factors(totals[name], densities)
        return state

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        b, deltas = combine.task_vectors(base, tasks)
        factors = state["tensors"][chunk.tensor].get("factors") or [None] * len(tasks)
        masks = self._masks(chunk, deltas, params)
        sparse = [
            dare.sparsify(d, keep, factor)
            for d, keep, factor in zip(deltas, masks, factors, strict=True)
        ]
        return combine.combine(
            b, sparse, [float(w) for w in params["weight"]], consensus=self.consensus,
            normalize=bool(params["normalize"]), lambda_=float(params["lambda"]),
        )  # fmt: skip

    # -- fused kernels (`ram_dist.kernels.della_numba`) ----------------------------------

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk (both passes, rescaling or not)."""
        return True

    @staticmethod
    def _kernel_tasks(chunk: Chunk, params: TensorParams, size: int) -> dict[str, Any]:
        """The kernels' per-task arguments for a chunk of `size` elements: where no task is
        sampled (density 1: not `whole_rows`), the chunk is one group."""
        seed = int(params["seed"])
        densities = [float(d) for d in params["density"]]
        sampled = any(d < 1 for d in densities)
        return {
            "start": chunk.start,
            "groups": rank_groups(chunk.shape) if sampled else (max(size, 1), 1),
            "stream_keys": [
                rng.stream_key(seed, t, chunk.tensor) if d < 1 else None
                for t, d in enumerate(densities)
            ],
            "densities": densities,
            "epsilons": [float(e) for e in params["epsilon"]],
        }

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The L1 round by the fused kernel; None for groups too long for its ranks."""
        chunk, params = work.chunk, work.params
        if rank_groups(chunk.shape)[0] > 1 << 24:
            return None
        from ram_dist.kernels import della_numba

        base, *tasks = inputs
        stats = della_numba.statistics(
            base, tasks, **self._kernel_tasks(chunk, params, precision.value_count(base))
        )
        return {chunk.tensor: stats}, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` by the fused kernel, written straight into `out`."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        if rank_groups(chunk.shape)[0] > 1 << 24:
            return False
        from ram_dist.kernels import della_numba
        from ram_dist.methods.generalized_task_arithmetic.family import weight_sum

        weights = [float(w) for w in params["weight"]]
        factors = state["tensors"][chunk.tensor].get("factors") or [None] * len(weights)
        base, *tasks = inputs
        size = precision.value_count(base)  # a stored form's too
        della_numba.merge(
            base, tasks, out, **self._kernel_tasks(chunk, params, size), factors=factors,
            weights=weights, consensus=self.consensus, normalize=bool(params["normalize"]),
            divisor=weight_sum(weights), lambda_=float(params["lambda"]), bf16_nan=bf16_nan,
        )  # fmt: skip
        return True

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """The seed of the keep masks."""
        seed = (report.get("della") or {}).get("seed")
        return [] if seed is None else [f"della seed: {seed}"]

    def report(self, state: State) -> dict[str, Any]:
        return {"della": {"seed": state.get("seed", 0)}}


#: The members, with mergekit's names.
METHODS = (
    Della(
        "della", True, "DELLA",
        "DELLA: drop changes at random, larger ones in a row kept more often, rescale, "
        "elect a sign",
    ),
    Della(
        "della_linear", False, "Linear DELLA",
        "DELLA's drop by magnitude rank and rescale, then the weighted sum",
    ),
)  # fmt: skip
