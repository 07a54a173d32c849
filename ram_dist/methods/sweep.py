"""Several merges as one method for the engine (a sweep's variants): one reduce pass gathers
every variant's statistics from the same reads, and the map pass makes every variant's bytes
from the blocks it read once (`outputs`, `output_params`).

A tensor's parameters are `{"variants": (p_0, ..., p_k)}`, each variant's own; the state is
`{"variants": [s_0, ..., s_k], "share": [...]}`. Variants whose statistics coincide in a
round compute them once (`share[k]`: the variant whose statistics variant k takes): same
kind of method, same parameters among those its statistics depend on
(`statistics_parameters`), same state (or the part of it the round reads,
`statistics_state`). RAM+ over `r` and `alpha` counts once; TIES's first round (magnitude
histograms) is one for every density, and TIES and consensus TIES of one density share every
round.

Driver side and workers; no torch at import time, as every method module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ram_dist.methods.protocol import Defaults, MergeMethod, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: Separates a variant's index from its statistic's key in the summed statistics.
_SEP = "|"


def _variant(work: ChunkWork, k: int) -> ChunkWork:
    """Variant `k`'s own work on the chunk: its parameters and state."""
    return work.of(work.params["variants"][k], work.state["variants"][k])


def variant_params(params: Mapping[str, TensorParams], k: int) -> dict[str, TensorParams]:
    """Every tensor's parameters of variant `k`."""
    return {name: p["variants"][k] for name, p in params.items()}


@dataclass(frozen=True)
class Variants(Defaults):
    """The methods of a sweep's variants, in order, driven as one (driver and workers)."""

    methods: tuple[MergeMethod, ...]
    name: str = "sweep"

    @property
    def rounds(self) -> int:  # type: ignore[override]
        return max(m.rounds for m in self.methods)

    @property
    def reads_stored(self) -> bool:  # type: ignore[override]
        return all(getattr(m, "reads_stored", False) for m in self.methods)

    @property
    def parameters(self) -> tuple[Any, ...]:
        return ()

    def whole_rows(self, params: TensorParams) -> bool:
        return any(m.whole_rows(p) for m, p in zip(self.methods, params["variants"], strict=True))

    def fuses(self, params: TensorParams) -> bool:
        return all(m.fuses(p) for m, p in zip(self.methods, params["variants"], strict=True))

    def outputs(self, state: State) -> list[tuple[MergeMethod, State]]:
        """Each variant's method and state, in order: what the map pass makes, one output
        each."""
        return list(zip(self.methods, state["variants"], strict=True))

    def output_params(self, params: TensorParams, k: int) -> TensorParams:
        """Variant `k`'s parameters of one tensor."""
        return params["variants"][k]

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        states = [
            m.initial_state(variant_params(params, k), numel, n_tasks)
            for k, m in enumerate(self.methods)
        ]
        return {"variants": states, "share": self._share(0, params, states)}

    def _share(
        self, round_: int, params: Mapping[str, TensorParams], states: Sequence[State]
    ) -> list[int]:
        """For each variant, the first variant whose statistics of `round_` are its own."""
        first: dict[str, int] = {}
        share = []
        for k, m in enumerate(self.methods):
            if round_ >= m.rounds:
                share.append(k)
                continue
            names = getattr(m, "statistics_parameters", None)
            own = {
                t: (p["variants"][k] if names is None else {n: p["variants"][k][n] for n in names})
                for t, p in params.items()
            }
            read = getattr(m, "statistics_state", None)
            state = states[k] if read is None else read(round_, states[k])
            key = json.dumps(
                [type(m).__module__, type(m).__qualname__, m.rounds, own, state],
                sort_keys=True, default=repr,
            )  # fmt: skip
            share.append(first.setdefault(key, k))
        return share

    def _counting(self, round_: int, state: State, tensor: str) -> list[int]:
        """The variants that compute statistics of `tensor` in `round_` for all that share
        them."""
        return [
            k
            for k, m in enumerate(self.methods)
            if state["share"][k] == k
            and round_ < m.rounds
            and m.active(round_, state["variants"][k], tensor)
        ]

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return any(
            round_ < m.rounds and m.active(round_, s, tensor)
            for m, s in zip(self.methods, state["variants"], strict=True)
        )

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k in self._counting(work.round_, work.state, work.chunk.tensor):
            got = self.methods[k].chunk_statistics(_variant(work, k), base, tasks)
            out.update({f"{k}{_SEP}{key}": value for key, value in got.items()})
        return out

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], list[int] | None, np.ndarray | None] | None:
        """Each counting variant's fused statistics; the first also counts NaN/Inf (and the
        precision check) when asked. None when any declines: all then run eagerly."""
        out: dict[str, np.ndarray] = {}
        counts: list[int] | None = None
        swept: np.ndarray | None = None
        for i, k in enumerate(self._counting(work.round_, work.state, work.chunk.tensor)):
            own = replace(_variant(work, k), count_nonfinite=work.count_nonfinite and i == 0)
            got = self.methods[k].fused_statistics(own, inputs)
            if got is None:
                return None
            stats, *rest = got
            if i == 0:
                counts, swept = (*rest, None)[:2]
            out.update({f"{k}{_SEP}{key}": value for key, value in stats.items()})
        return out, counts, swept

    def finalize(self, end: RoundTotals) -> State:
        """Each variant's own finalize, on the statistics of the variant it shares them with.
        A variant none of whose tensors was active this round is left as it is (the engine
        does not finalize a round that read nothing), except in round 0, which every job
        reads."""
        round_, totals, params, state = end.round_, end.totals, end.params, end.state
        states = list(state["variants"])
        for k, m in enumerate(self.methods):
            if round_ >= m.rounds:
                continue
            if round_ > 0 and not any(m.active(round_, states[k], t) for t in params):
                continue
            prefix = f"{state['share'][k]}{_SEP}"
            own = {key[len(prefix) :]: v for key, v in totals.items() if key.startswith(prefix)}
            k_params = variant_params(params, k)
            states[k] = m.finalize(replace(end, totals=own, params=k_params, state=states[k]))
        return {"variants": states, "share": self._share(round_ + 1, params, states)}

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        raise TypeError("a sweep's map pass merges each variant on its own (`outputs`)")

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        raise TypeError("a sweep's map pass merges each variant on its own (`outputs`)")

    def report(self, state: State) -> dict[str, Any]:
        return {}
