"""Several merges as one method for the engine (a sweep's variants): one reduce pass gathers
every variant's statistics from the same reads, and the map pass makes every variant's bytes
from the blocks it read once (`outputs`, `output_params`).

A tensor's parameters are `{"variants": (p_0, ..., p_k)}`, each variant's own; the state is
`{"variants": [s_0, ..., s_k], "share": [...]}`. Variants whose statistics coincide in a
round compute them once (`share[k]`: the variant whose statistics variant k takes): same
kind of method, same parameters among those its statistics depend on
(`statistics_parameters`), same state. RAM+ over `r` and `alpha` counts once.

Driver side and workers; no torch at import time, as every method module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ram_dist.methods.protocol import Chunk, Defaults, MergeMethod, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Separates a variant's index from its statistic's key in the summed statistics.
_SEP = "|"


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
            key = json.dumps(
                [type(m).__module__, type(m).__qualname__, m.rounds, own, states[k]],
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
        self,
        round_: int,
        chunk: Chunk,
        base: torch.Tensor,
        tasks: list[torch.Tensor],
        params: TensorParams,
        state: State,
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k in self._counting(round_, state, chunk.tensor):
            got = self.methods[k].chunk_statistics(
                round_, chunk, base, tasks, params["variants"][k], state["variants"][k]
            )
            out.update({f"{k}{_SEP}{key}": value for key, value in got.items()})
        return out

    def fused_statistics(
        self,
        round_: int,
        chunk: Chunk,
        inputs: Sequence[np.ndarray],
        params: TensorParams,
        state: State,
        count_nonfinite: bool,
    ) -> tuple[dict[str, np.ndarray], list[int] | None, np.ndarray | None] | None:
        """Each counting variant's fused statistics; the first also counts NaN/Inf (and the
        precision check) when asked. None when any declines: all then run eagerly."""
        out: dict[str, np.ndarray] = {}
        counts: list[int] | None = None
        swept: np.ndarray | None = None
        for i, k in enumerate(self._counting(round_, state, chunk.tensor)):
            got = self.methods[k].fused_statistics(
                round_, chunk, inputs, params["variants"][k], state["variants"][k],
                count_nonfinite and i == 0,
            )  # fmt: skip
            if got is None:
                return None
            stats, *rest = got
            if i == 0:
                counts, swept = (*rest, None)[:2]
            out.update({f"{k}{_SEP}{key}": value for key, value in stats.items()})
        return out, counts, swept

    def finalize(
        self,
        round_: int,
        totals: dict[str, torch.Tensor],
        params: Mapping[str, TensorParams],
        numel: Mapping[str, int],
        state: State,
    ) -> State:
        """Each variant's own finalize, on the statistics of the variant it shares them with.
        A variant none of whose tensors was active this round is left as it is (the engine
        does not finalize a round that read nothing), except in round 0, which every job
        reads."""
        states = list(state["variants"])
        for k, m in enumerate(self.methods):
            if round_ >= m.rounds:
                continue
            if round_ > 0 and not any(m.active(round_, states[k], t) for t in params):
                continue
            prefix = f"{state['share'][k]}{_SEP}"
            own = {key[len(prefix) :]: v for key, v in totals.items() if key.startswith(prefix)}
            states[k] = m.finalize(round_, own, variant_params(params, k), numel, states[k])
        return {"variants": states, "share": self._share(round_ + 1, params, states)}

    def merge_chunk(self, *args: Any) -> torch.Tensor:
        raise TypeError("a sweep's map pass merges each variant on its own (`outputs`)")

    def fused_merge(self, *args: Any, **kwargs: Any) -> bool:
        raise TypeError("a sweep's map pass merges each variant on its own (`outputs`)")

    def report(self, state: State) -> dict[str, Any]:
        return {}
