"""What the geometric methods share: a merged tensor that is a linear combination of its
inputs, with coefficients that depend only on their Gram matrix.

slerp, nuslerp, multislerp and karcher all compute norms and dot products of whole tensors
and then blend the tensors themselves, so each of them is, per tensor:

1. one reduce round: the exact sums `x_i . x_j` of the vectors it interpolates (the inputs, or
   their task vectors), `exact_sums.product_sum` per pair, summed as integers by the engine;
2. on the driver (`finalize`), once per tensor: the Gram matrix rounded once to float64, the
   method's angles and coefficients in float64 with Python's `math`, each coefficient that
   multiplies a tensor rounded to float32 once (`f32`), kept in the state;
3. the map pass, element-wise in float32 (`blend`): `((c_0 x_0 + c_1 x_1) + ...) / d + base`,
   each product rounded, then each sum, op by op (no fused multiply-add), so any split, worker
   count or device gives the same bytes.

`SpanMethod` is that protocol; a method gives its vectors (`vectors`) and its coefficients
from the Gram matrix (`coefficients`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ram_dist.methods import exact_sums
from ram_dist.methods import task_vectors as measured
from ram_dist.methods.protocol import Eager, MergekitRule, State, TensorParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ram_dist.methods.protocol import ChunkWork, RoundTotals

#: Gram matrix of a tensor's vectors, float64, `gram[i][j] = x_i . x_j`.
Gram = list[list[float]]


def f32(x: float) -> float:
    """`x` rounded once to float32 (to nearest, ties to even), as a Python float."""
    import numpy as np

    with np.errstate(over="ignore"):
        return float(np.float32(x))


def pairs(n: int) -> list[tuple[int, int]]:
    """The pairs (i, j), i <= j, whose products a Gram statistic sums, in its order."""
    return [(i, j) for i in range(n) for j in range(i, n)]


def gram_statistic(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64[pairs, BINS]: the exact sums `x_i . x_j` of one chunk, for `pairs(n)`."""
    import torch

    n = len(vectors)
    return torch.stack([exact_sums.product_sum(vectors[i], vectors[j]) for i, j in pairs(n)])


def gram(total: Any, n: int) -> Gram:
    """The Gram matrix from a summed `gram_statistic`, each entry rounded once to float64."""
    rows = total.tolist() if not isinstance(total, list) else total
    g = [[0.0] * n for _ in range(n)]
    for k, (i, j) in enumerate(pairs(n)):
        g[i][j] = g[j][i] = exact_sums.value(rows[k])
    return g


def row_grams(vectors: Sequence[torch.Tensor], row: int) -> list[Gram]:
    """The Gram matrix of each row of `row` elements of flat vectors that hold whole rows,
    exact sums rounded once to float64: by the fused kernel on CPU tensors (where numba is
    installed), else by the eager rule on the tensors' device; the same integers either way."""
    import numpy as np
    import torch

    n = len(vectors)
    stats = None
    if all(v.device.type == "cpu" for v in vectors):
        stacked = np.stack([v.reshape(-1).to(torch.float32).numpy() for v in vectors])
        stats = exact_sums.row_gram(stacked, pairs(n), row)
    if stats is None:
        found = [exact_sums.row_sums(vectors[i], vectors[j], 0, row)[1] for i, j in pairs(n)]
        stats = torch.stack(found, dim=1).cpu().numpy()
    rows = stats.shape[0]
    values = row_values(stats.reshape(rows * len(pairs(n)), -1))
    out = [[[0.0] * n for _ in range(n)] for _ in range(rows)]
    for r in range(rows):
        for k, (i, j) in enumerate(pairs(n)):
            out[r][i][j] = out[r][j][i] = values[r * len(pairs(n)) + k]
    return out


def row_values(stats: Any) -> list[float]:
    """`exact_sums.value` of each row of int64[rows, BINS] (numpy)."""
    return [exact_sums.value(row) for row in stats]


def norm(g: Gram, coefficients: Sequence[float]) -> float:
    """`||sum_i c_i x_i||` in float64 from the Gram matrix."""
    n = len(coefficients)
    square = math.fsum(
        coefficients[i] * coefficients[j] * g[i][j] for i in range(n) for j in range(n)
    )
    return math.sqrt(max(square, 0.0))


def dot(g: Gram, a: Sequence[float], b: Sequence[float]) -> float:
    """`(sum_i a_i x_i) . (sum_j b_j x_j)` in float64 from the Gram matrix."""
    n = len(a)
    return math.fsum(a[i] * b[j] * g[i][j] for i in range(n) for j in range(n))


def blend(
    vectors: Sequence[torch.Tensor],
    factors: Sequence[float] | Sequence[torch.Tensor],
    *,
    divisor: float | torch.Tensor | None = None,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """`((f_0 * x_0 + f_1 * x_1) + ...) / divisor + base` in float32, op by op: each product
    rounded, then each sum (no fused multiply-add), in input order. Factors are float32
    values (Python floats already rounded by `f32`, or float32 tensors that broadcast)."""
    import torch

    def scaled(x: torch.Tensor, f: float | torch.Tensor) -> torch.Tensor:
        if isinstance(f, float):
            f = torch.tensor(f, dtype=torch.float32, device=x.device)
        return x * f

    out = scaled(vectors[0], factors[0])
    for x, f in zip(vectors[1:], factors[1:], strict=True):
        out = out + scaled(x, f)
    if divisor is not None:
        if isinstance(divisor, float):
            divisor = torch.tensor(divisor, dtype=torch.float32, device=out.device)
        out = out / divisor
    if base is not None:
        out = base + out
    return out


def float32(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.to(torch.float32)


def task_vectors(base: torch.Tensor, tasks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each task's float32 update, against the base at the task's precision."""
    return measured.task_vectors(base, tasks)[1]


class SpanMethod(MergekitRule, Eager):
    """The protocol of a method whose tensor is `blend(vectors, coefficients)` with
    coefficients from the vectors' Gram matrix (one reduce round; see the module).

    A member says what it blends (`blends`: the task vectors, the models, or the base and
    one model) and whether the base is added back (`adds_base`), and gives `coefficients`
    (the driver's float64 math from the Gram matrix: a dict with the float32 `factors`,
    optionally a `divisor`, and what its report counts); it may give `passthrough` (one
    model taken as it is, no round) and `whole_rows` with `merge_rows` (nuslerp's rows and
    columns)."""

    rounds: int = 1
    reads_stored: bool = True
    """The kernels read quantized inputs as stored: the Gram round's
    (`vector_sums_numba`) and the blend (`blend_numba`)."""
    adds_base: bool = False
    """Whether the base is added to the blend (the vectors are task vectors)."""
    blends: str = "deltas"
    """What the Gram matrix is of and what is blended: `deltas` (the task vectors),
    `models` (the task models) or `pair` (the base, then the one task model)."""

    def vectors(self, base: torch.Tensor, tasks: list[torch.Tensor]) -> list[torch.Tensor]:
        """The float32 vectors of one chunk (`blends`)."""
        if self.blends == "deltas":
            return task_vectors(base, tasks)
        if self.blends == "pair":
            b, (model,) = measured.task_values(base, tasks[:1])
            return [b, model]
        return [float32(t) for t in tasks]

    def fused_statistics(
        self, work: ChunkWork, inputs: Sequence[np.ndarray]
    ) -> tuple[dict[str, np.ndarray], None] | None:
        """The Gram statistic by the records' kernel (`vector_sums_numba.gram`), bin for
        bin `chunk_statistics`', the inputs as stored (a quantized one decoded as it
        loads); None where numba is missing."""
        chunk = work.chunk
        from ram_dist import kernels

        kernel = kernels.numba_module("vector_sums_numba")
        if kernel is None:
            return None
        base, *tasks = inputs
        mode = {"deltas": kernel.DELTAS, "pair": kernel.PAIR, "models": kernel.MODELS}
        n = self.n_vectors(len(tasks))
        stats = kernel.gram(base, tasks, mode[self.blends], pairs(n))[0]
        return {chunk.tensor: stats}, None

    def fused_merge(self, work: ChunkWork, inputs: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """`merge_chunk` cast to the output's dtype by the fused blend kernel, written into
        `out`; False for nuslerp's rows and columns (factors per row or column) and for
        karcher's zeros, which run eagerly."""
        chunk, params, state, bf16_nan = work.chunk, work.params, work.state, work.bf16_nan
        from ram_dist import kernels

        kernel = kernels.numba_module("blend_numba")
        if kernel is None or self.whole_rows(params):
            return False
        base, *tasks = inputs
        keep = self.passthrough(len(tasks))
        if keep is not None:  # the model as it is: 1.0 * x is x, sign and all
            mode = kernel.REBASED if self.needs_base else kernel.MODELS
            kernel.blend(base, [tasks[keep]], out, mode=mode, factors=[1.0], bf16_nan=bf16_nan)
            return True
        info = state["tensors"][chunk.tensor]
        if info.get("zeros"):
            return False
        mode = {"deltas": kernel.DELTAS, "pair": kernel.PAIR, "models": kernel.MODELS}
        kernel.blend(
            base, tasks, out, mode=mode[self.blends], factors=info["factors"],
            divisor=info.get("divisor"), add_base=self.adds_base, bf16_nan=bf16_nan,
        )  # fmt: skip
        return True

    def fuses(self, params: TensorParams) -> bool:
        """The kernels take every chunk of a tensor blended with one set of factors (not
        nuslerp's rows and columns)."""
        return not self.whole_rows(params)

    def coefficients(self, g: Gram, params: TensorParams, where: str) -> dict[str, Any]:
        raise NotImplementedError

    def n_vectors(self, n_tasks: int) -> int:
        """How many vectors the Gram matrix is of: the base and the model, or the tasks."""
        return 2 if self.blends == "pair" else n_tasks

    def passthrough(self, n_tasks: int) -> int | None:
        """The task whose values the tensor takes as they are (no round), or None."""
        return None

    def needs_round(self, params: TensorParams) -> bool:
        """Whether a tensor with these parameters takes the reduce round (not where the
        method computes each row inside its chunk)."""
        return not self.whole_rows(params)

    # -- the protocol -------------------------------------------------------------------

    def initial_state(
        self, params: Mapping[str, TensorParams], numel: Mapping[str, int], n_tasks: int
    ) -> State:
        rounds = self.passthrough(n_tasks) is None
        return {
            "n_vectors": self.n_vectors(n_tasks),
            "tensors": {name: {} for name, p in params.items() if rounds and self.needs_round(p)},
        }

    def active(self, round_: int, state: State, tensor: str) -> bool:
        return tensor in state.get("tensors", {})

    def chunk_statistics(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        chunk = work.chunk
        return {chunk.tensor: gram_statistic(self.vectors(base, tasks))}

    def finalize(self, end: RoundTotals) -> State:
        totals, params, state = end.totals, end.params, end.state
        n = state["n_vectors"]
        for name, info in state["tensors"].items():
            if name not in totals:
                continue
            g = gram(totals[name], n)
            info.update(self.coefficients(g, params[name], f"tensor {name!r}"))
        return state

    def merge_chunk(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        chunk, params, state = work.chunk, work.params, work.state
        keep = self.passthrough(len(tasks))
        if keep is not None:  # with a base, the model's values measured against it
            return (
                measured.task_values(base, tasks)[1][keep]
                if self.needs_base
                else float32(tasks[keep])
            )
        if self.whole_rows(params):
            return self.merge_rows(work, base, tasks)
        info = state["tensors"][chunk.tensor]
        if info.get("zeros"):
            import torch

            return torch.zeros(base.shape, dtype=torch.float32, device=base.device)
        return blend(
            self.vectors(base, tasks),
            info["factors"],
            divisor=info.get("divisor"),
            base=float32(base) if self.adds_base else None,
        )

    def merge_rows(
        self, work: ChunkWork, base: torch.Tensor, tasks: list[torch.Tensor]
    ) -> torch.Tensor:
        """The map pass of a tensor computed on whole rows (`whole_rows`)."""
        raise NotImplementedError

    def report(self, state: State) -> dict[str, Any]:
        """How many tensors took the linear branch (slerp, multislerp: `linear` in a tensor's
        coefficients)."""
        tensors = state.get("tensors", {})
        linear = sum(1 for info in tensors.values() if info.get("linear"))
        return {self.name: {"tensors_blended_linearly": linear}} if tensors else {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """One line per key of what `report` added."""
        return [
            f"{self.name} {key.replace('_', ' ')}: {value}"
            for key, value in (report.get(self.name) or {}).items()
        ]
