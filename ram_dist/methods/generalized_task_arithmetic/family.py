"""mergekit's generalized task arithmetic family as one configured method class,
`TaskArithmeticFamily`, and its members (`METHODS`): `task_arithmetic`, `ties`,
`dare_linear` and `dare_ties`, with mergekit's names, parameters and defaults, and
mergekitty's `consensus_ta` and `consensus_ties` with its own. A member is an optional
sparsification (by magnitude: TIES; at random: DARE), then the weighted combine step with
optional sign consensus, then, for the consensus members, TALL masks (`tall`).

Whole-tensor quantities are reduce rounds: TIES's exact top-k cut (`ties`, over `topk`:
rounds 0-1 magnitude histograms, then, when the cut splits a group of equal magnitudes,
rounds 2-3 histograms of their flat indices, so the kept set is a rule of each element) and
the L1 norms of the rescale rule (`dare.l1_statistic`, exact integer sums; for TIES the kept
L1 is summed in round 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.errors import RamDistError
from ram_dist.methods.generalized_task_arithmetic import combine, dare, rng, tall, ties, topk
from ram_dist.methods.parameters import (
    DENSITY,
    INT8_MASK,
    LAMBDA,
    NORMALIZE,
    RESCALE,
    SEED,
    TALL_LAMBDA,
    WEIGHT,
    K,
    Parameter,
    variant,
)
from ram_dist.methods.protocol import (
    MERGEKIT_TEXT,
    Defaults,
    MergekitRule,
    State,
    TensorParams,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: mergekitty's tolerance below which an L1 norm counts as zero in its consensus methods'
#: rescale (`sparsify.rescale_sum`; mergekit's is `dare.RESCALE_EPS`).
TALL_RESCALE_EPS = 1e-8


def weight_sum(weights: Sequence[float]) -> float:
    """The float32 sum of the weights in task order (`combine.ordered_sum`), or 1
    where mergekit takes it as zero: what `normalize` divides by."""
    import numpy as np

    total = np.float32(0.0)
    for w in weights:
        total = np.float32(total + np.float32(w))
    return 1.0 if abs(total) < np.float32(combine.WEIGHT_SUM_EPS) else float(total)


def _densities(params: TensorParams) -> list[float]:
    return [float(d) for d in params["density"]]


def _weights(params: TensorParams) -> list[float]:
    return [float(w) for w in params["weight"]]


@dataclass(frozen=True)
class TaskArithmeticFamily(MergekitRule, Defaults):
    """mergekit's generalized task arithmetic: sparsify (none, magnitude, random), weight,
    optional sign consensus, optional normalize, lambda; or, with `tall` (mergekitty's
    consensus members), TALL masks in place of lambda's scaling."""

    name: str
    sparsify: str | None  # None, "magnitude" (TIES) or "random" (DARE)
    consensus: bool
    label: str = ""
    reference: str = ""
    summary: str = ""
    tall: bool = False  # mergekitty's consensus_*: TALL masks (`tall`), lambda their threshold
    reads_stored: bool = True
    """Its kernels (`ties_numba`, `tall_numba`, `dare_numba`) read quantized inputs as stored."""

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """mergekit's `GeneralizedTaskArithmeticMerge` parameters with this member's defaults
        (normalize for TIES, rescale for DARE), and DARE's seed (ram-dist's own); the
        consensus members take mergekitty's `k` and `lambda` per task instead of the one
        `lambda`."""
        normalize = variant(NORMALIZE, self.sparsify == "magnitude")
        lambda_ = (K, TALL_LAMBDA) if self.tall else (LAMBDA,)
        if self.sparsify is None:  # no sparsification: density and rescale do nothing
            return (
                WEIGHT,
                variant(DENSITY, effect=False),  # the method reads it; it must stay 1
                normalize,
                *lambda_,
                variant(RESCALE, False, effect=False, passed=False),
                INT8_MASK,
            )
        rescale = variant(RESCALE, self.sparsify == "random")
        seed = (SEED,) if self.sparsify == "random" else ()
        return (WEIGHT, DENSITY, normalize, *lambda_, rescale, *seed, INT8_MASK)

    @property
    def description(self) -> str:
        if self.tall:
            return MERGEKIT_TEXT.format(name=self.name).replace("mergekit", "mergekitty")
        return MERGEKIT_TEXT.format(name=self.name)

    @property
    def rounds(self) -> int:
        return {None: 0, "random": 1, "magnitude": 4}[self.sparsify]

    @property
    def rounds_note(self) -> str:
        if self.sparsify == "magnitude":
            return (
                "TIES needs its 3rd and 4th round only where the cut falls inside equal magnitudes"
            )
        return ""

    def check(self, params: TensorParams, where: str) -> None:
        """What the parameters' own checks cannot see: task arithmetic sparsifies nothing;
        the TALL members' `k` is one count (mergekitty reads the first task's) and no more
        than the tasks (else no element is kept: the merge would be the base)."""
        if self.sparsify is None and any(d != 1 for d in params["density"]):
            raise RamDistError(f"{where}: {self.name} has no density (use ties or dare_*)")
        if not self.tall:
            return
        ks = list(params["k"])
        if len(set(ks)) > 1:
            raise RamDistError(
                f"{where}: parameter k must be the same for every task ({self.name} counts "
                f"tasks once per element; mergekitty reads only the first), got {ks}"
            )
        if ks and ks[0] > len(ks):
            raise RamDistError(
                f"{where}: parameter k is {ks[0]} but there are {len(ks)} tasks: no element "
                f"would be kept; use k <= {len(ks)}"
            )

    # -- reduce rounds ------------------------------------------------------------------

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        """Per tensor: which tasks TIES must cut (and keep how many), whether L1 rescale runs."""
        tensors: dict[str, Any] = {}
        seed = 0
        for name, p in params.items():
            densities = _densities(p)
            rescale = _rescales(p)
            seed = p.get("seed", 0)
            if self.sparsify == "random":
                tensors[name] = {"rescale": rescale}
            elif self.sparsify == "magnitude":
                cuts = [
                    {"k": topk.kept_count(d, numel[name])} if ties.needs_cut(d, numel[name])
                    else None
                    for d in densities
                ]  # fmt: skip
                tensors[name] = {"cut": any(cuts), "cuts": cuts, "rescale": rescale}
        return {"tensors": tensors, "seed": seed}

    @property
    def statistics_parameters(self) -> tuple[str, ...] | None:  # type: ignore[override]
        """TIES's rounds read only the state (each tensor's cuts); DARE's every parameter."""
        return () if self.sparsify == "magnitude" else None

    def statistics_state(self, round_: int, state: State) -> Any:
        """What a round's statistics read of the state (a sweep's variants that agree on it
        share the round, `methods.sweep`): TIES's first round, the magnitude histograms of
        every task, only which tensors are cut and which rescale, whatever the densities;
        each later round, the cuts found so far (the same for TIES and consensus TIES of one
        density)."""
        if self.sparsify != "magnitude":
            return state
        tensors = state["tensors"]
        if round_ == 0:
            return {n: [info["cut"], info["rescale"]] for n, info in tensors.items()}
        return tensors

    def active(self, round_: int, state: State, tensor: str) -> bool:
        info = state.get("tensors", {}).get(tensor)
        if self.sparsify == "random":
            return bool(info and info["rescale"])
        if info is None or not info["cut"]:
            return False
        if round_ <= 1:
            return True
        ordered = any(ties.ordered(c) for c in info["cuts"])
        return ordered or (round_ == 2 and info["rescale"])

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        round_, chunk, params, state = work.round_, work.chunk, work.params, work.state
        if self.sparsify == "random":
            stats = dare.chunk_statistics(
                base, tasks, seed=params["seed"], name=chunk.tensor, start=chunk.start,
                densities=_densities(params),
            )  # fmt: skip
            return {chunk.tensor: stats}
        return ties.chunk_statistics(round_, chunk, base, tasks, state["tensors"][chunk.tensor])

    def finalize(self, end: RoundTotals) -> State:
        round_, totals, params, state = end.round_, end.totals, end.params, end.state
        tensors = state["tensors"]
        if self.sparsify == "random":
            for name, info in tensors.items():
                if name in totals:
                    info["factors"] = dare.rescale_factors(totals[name], _densities(params[name]))
            return state
        for name, info in tensors.items():
            if name in totals and info["cut"]:
                ties.finalize(round_, name, totals, info["cuts"], self._rescale_eps)
        return state

    # -- map pass ----------------------------------------------------------------------

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        import torch

        if self.tall:
            return self._tall_chunk(work, base, tasks)
        weights = _weights(params)
        normalize = bool(params["normalize"])
        lam = float(params["lambda"])
        if self.sparsify is None:
            return combine.merge_chunk(base, tasks, weights, normalize=normalize, lambda_=lam)
        info = state["tensors"][chunk.tensor]
        if self.sparsify == "random":
            factors = info.get("factors") or [None] * len(tasks)
            return dare.merge_chunk(
                base, tasks, weights, seed=params["seed"], name=chunk.tensor, start=chunk.start,
                densities=_densities(params), factors=factors, consensus=self.consensus,
                normalize=normalize, lambda_=lam,
            )  # fmt: skip
        b, deltas = combine.task_vectors(base, tasks)
        sparse = []
        for d, density, c in zip(deltas, _densities(params), info["cuts"], strict=True):
            if c is None:  # density >= 1: untouched; density <= 0: zeros (as in mergekit)
                sparse.append(d if density >= 1 else torch.zeros_like(d))
                continue
            keys = topk.magnitude_keys(d)
            keep = topk.keep_mask(keys, c["threshold"], chunk.start, c.get("index_cut"))
            sparse.append(dare.sparsify(d, keep, c.get("factor")))
        return combine.combine(
            b, sparse, weights, consensus=self.consensus, normalize=normalize, lambda_=lam
        )

    @property
    def _rescale_eps(self) -> float:
        return TALL_RESCALE_EPS if self.tall else dare.RESCALE_EPS

    def _tall_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        """mergekitty's consensus members (`tall`): the combine step without lambda on the
        (TIES-cut) task vectors, then TALL masks against each whole task vector (rescaled
        by its L1 factor, if any, as mergekitty rescales it in place), then the base."""
        chunk, params, state = work.chunk, work.params, work.state
        import torch

        b, deltas = combine.task_vectors(base, tasks)
        whole, sparse = list(deltas), list(deltas)  # what the masks see; what is combined
        cuts = state["tensors"][chunk.tensor]["cuts"] if self.sparsify else [None] * len(tasks)
        for t, (d, c) in enumerate(zip(deltas, cuts, strict=True)):
            if c is None:  # no cut: density 1 (density <= 0 is refused) or consensus_ta
                continue
            keys = topk.magnitude_keys(d)
            keep = topk.keep_mask(keys, c["threshold"], chunk.start, c.get("index_cut"))
            if c.get("factor") is not None:  # mergekitty: `delta *= factor`, then the mask
                whole[t] = d * torch.tensor(c["factor"], dtype=d.dtype, device=d.device)
            sparse[t] = whole[t] * keep.reshape(d.shape).to(d.dtype)
        mixed = combine.mix(
            sparse, _weights(params), consensus=self.consensus,
            normalize=bool(params["normalize"]), lambda_=1.0,
        )  # fmt: skip
        lambdas = [float(x) for x in params["lambda"]]
        return b + tall.consensus(whole, mixed, lambdas, int(params["k"][0]))

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """TIES's histograms by its fused kernel, DARE's L1 statistics by its own
        (`dare_numba`); None for TIES's L1 statistics of rescaling, which no kernel computes."""
        round_, chunk, state = work.round_, work.chunk, work.state
        if self.sparsify == "random":
            from ram_dist.kernels import dare_numba

            base, *tasks = inputs
            stats = dare_numba.statistics(base, tasks, start=chunk.start, **_draws(work))
            return {chunk.tensor: stats}, None
        if self.sparsify != "magnitude":
            return None
        info = state["tensors"][chunk.tensor]
        if info["rescale"]:
            return None
        return {chunk.tensor: ties.fused_statistics(round_, chunk, inputs, info["cuts"])}, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` by a fused kernel, written straight into `out`; False where none
        applies (TIES's L1 rescaling, but for the TALL members, whose kernel scales)."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        if self.sparsify == "random":
            return self._dare_fused(work, inputs, out)
        if self.tall:
            return self._tall_fused(work, inputs, out)
        from ram_dist.kernels import ties_numba

        densities = _densities(params)
        cuts: list[dict[str, Any] | None] = [None] * (len(inputs) - 1)
        if self.sparsify == "magnitude":
            cuts = state["tensors"][chunk.tensor]["cuts"]
            if any(c is not None and c.get("factor") is not None for c in cuts):
                return False
        keep, bounds = [], []
        for density, c in zip(densities, cuts, strict=True):
            if c is None:
                keep.append(ties_numba.KEEP_ALL if density >= 1 else ties_numba.KEEP_NONE)
                bounds.append((-1, -1))
            else:
                keep.append(ties_numba.KEEP_CUT)
                bounds.append((c["threshold"], c.get("index_cut", -1)))
        weights = _weights(params)
        base, *tasks = inputs
        ties_numba.merge(
            base, tasks, out, weights=weights, keep=keep, cuts=bounds, start=chunk.start,
            consensus=self.consensus, normalize=bool(params["normalize"]),
            divisor=weight_sum(weights), lambda_=float(params["lambda"]),
            bf16_nan=bf16_nan,
        )  # fmt: skip
        return True

    def _dare_fused(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`dare.merge_chunk` by `dare_numba`'s kernel (the draws, the L1 factors, if any,
        and the combine step)."""
        from ram_dist.kernels import dare_numba

        params = work.params
        info = work.state["tensors"][work.chunk.tensor]
        weights = _weights(params)
        base, *tasks = inputs
        dare_numba.merge(
            base, tasks, out, start=work.chunk.start, **_draws(work),
            factors=info.get("factors") or [None] * len(tasks), weights=weights,
            consensus=self.consensus, normalize=bool(params["normalize"]),
            divisor=weight_sum(weights), lambda_=float(params["lambda"]),
            bf16_nan=work.bf16_nan,
        )  # fmt: skip
        return True

    def _tall_fused(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`_tall_chunk` by `tall_numba`'s kernel (TIES's cuts and L1 factors as they are)."""
        chunk, params, state = work.chunk, work.params, work.state
        from ram_dist.kernels import tall_numba

        n = len(inputs) - 1
        cuts = state["tensors"][chunk.tensor]["cuts"] if self.sparsify else [None] * n
        weights = _weights(params)
        base, *tasks = inputs
        tall_numba.merge(
            base, tasks, out, weights=weights,
            cuts=[tall_numba.NO_CUT if c is None else (c["threshold"], c.get("index_cut", -1))
                  for c in cuts],
            factors=[None if c is None else c.get("factor") for c in cuts],
            lambdas=[float(x) for x in params["lambda"]], k=int(params["k"][0]),
            start=chunk.start, consensus=self.consensus, normalize=bool(params["normalize"]),
            divisor=weight_sum(weights), bf16_nan=work.bf16_nan,
        )  # fmt: skip
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk (DARE's too, its draws in the kernel) but those of
        L1 rescaling after a magnitude cut (eager L1 sums, and an eager map pass but for the
        consensus members)."""
        return self.sparsify == "random" or not _rescales(params)

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """TIES's count of cuts through equal magnitudes; DARE's seed."""
        lines = []
        for key in ("ties", "dare"):
            for name, value in (report.get(key) or {}).items():
                lines.append(f"{key} {name.replace('_', ' ')}: {value}")
        return lines

    def report(self, state: State) -> dict[str, Any]:
        tensors = state.get("tensors", {})
        if self.sparsify == "magnitude":
            ordered = sum(1 for info in tensors.values() for c in info["cuts"] if ties.ordered(c))
            return {"ties": {"cuts_through_equal_magnitudes": ordered}}
        if self.sparsify == "random":
            return {"dare": {"seed": state.get("seed", 0)}}
        return {}


def _draws(work: ChunkWork) -> dict[str, list[Any]]:
    """DARE's draws on a chunk's tensor, as `dare_numba` takes them: per task the stream key
    of its random bits (None where its density is >= 1: nothing dropped) and the keep
    threshold of its density (`dare.dare_keep_mask`)."""
    seed, name = work.params["seed"], work.chunk.tensor
    densities = _densities(work.params)
    return {
        "stream_keys": [
            rng.stream_key(seed, t, name) if d < 1 else None for t, d in enumerate(densities)
        ],
        "thresholds": [dare.keep_threshold(d) if d < 1 else 0 for d in densities],
    }


def _rescales(params: TensorParams) -> bool:
    """Whether L1 rescaling runs on a tensor: asked for, and some task drops values."""
    return bool(params.get("rescale")) and any(d < 1 for d in _densities(params))


#: The family's members, with mergekit's names, as `ram_dist.methods.METHODS` lists them.
METHODS = (
    TaskArithmeticFamily(
        "task_arithmetic", None, False, "Task Arithmetic", "Ilharco et al. 2023",
        summary="the base plus the weighted sum of the task vectors",
    ),
    TaskArithmeticFamily(
        "ties", "magnitude", True, "TIES", "Yadav et al. 2023",
        summary="TIES: keep each task's largest changes, elect a sign, average what agrees",
    ),
    TaskArithmeticFamily(
        "dare_linear", "random", False, "DARE (linear)", "Yu et al. 2024",
        summary="DARE: drop changes at random, rescale, add them up",
    ),
    TaskArithmeticFamily(
        "dare_ties", "random", True, "DARE (TIES)", "Yu et al. 2024",
        summary="DARE's random drop, then TIES's sign election",
    ),
    TaskArithmeticFamily(
        "consensus_ta", None, False, "Consensus Task Arithmetic", "Wang et al. 2024",
        summary="task arithmetic, kept only where at least k tasks' TALL masks hold",
        tall=True,
    ),
    TaskArithmeticFamily(
        "consensus_ties", "magnitude", True, "Consensus TIES", "Wang et al. 2024",
        summary="TIES, kept only where at least k tasks' TALL masks hold", tall=True,
    ),
)  # fmt: skip
