"""An independent reference of model_stock, sce, arcee_fusion, nearswap and passthrough,
written from the spec (`../shared/spec/ram.md`, "The rest of mergekit's methods") on whole
tensors, without ram_dist: exact sums by `math.fsum` over the float64 products, derived
factors in Python floats rounded once to float32, selections by a stable sort (ties to the
lowest flat index), arcee_fusion's softmax and KL with Python's `math.exp` and `math.log`.
Element-wise steps are float32 torch operations, as mergekit writes them.

Inputs are handed as stored (an FP8 tensor as its float32 value). Task vectors are measured
against the base at the task's precision (`reference.task_vector`: sce, model_stock's ratio);
the methods that blend values (nearswap, arcee_fusion, model_stock's mean) take a task's
value as `reference.task_value` gives it; passthrough takes the model as it is.
"""

from __future__ import annotations

import math
import struct

import torch
from reference import task_value, task_vector

State = dict[str, torch.Tensor]


def f32(x: float) -> float:
    """x rounded to float32 (to nearest even), as a Python float."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def fsum(values) -> float:
    return math.fsum(values)


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The exact sum of the float32 products, rounded once to float64."""
    return fsum(x * y for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """mergekit's rows (`dim=-1`): a 1-D tensor is one row."""
    return x.reshape(-1, x.shape[-1] if x.dim() else 1)


# ---------------------------------------------------------------- nearswap, passthrough


def nearswap(base: torch.Tensor, task: torch.Tensor, t: float) -> torch.Tensor:
    a, b = base.float(), task_value(base, task)
    distance = (a - b).abs().clamp(min=1e-6)
    weight = ((1 / distance) * t).clamp(0, 1)  # torch's `t / x`: a reciprocal, then times t
    return weight * b + (1 - weight) * a


def passthrough(task: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    x = task.float()
    return x if scale == 1 else x * torch.tensor(scale, dtype=torch.float32)


# ---------------------------------------------------------------- model_stock


def stock_ratio(deltas: list[torch.Tensor]) -> float:
    """t of one tensor or row, from exact sums, in Python floats; float32 at the end."""
    n = len(deltas)
    norms = [math.sqrt(dot(d, d)) for d in deltas]
    cosines = []
    for i in range(n):
        for j in range(i + 1, n):
            cos = dot(deltas[i], deltas[j]) / max(norms[i] * norms[j], 1e-6)
            cosines.append(min(max(cos, -1.0), 1.0))
    c = fsum(cosines) / len(cosines)
    denominator = 1 + (n - 1) * c
    return f32(0.0 if abs(denominator) < 1e-6 else n * c / denominator)


def model_stock(base: torch.Tensor, tasks: list[torch.Tensor], filter_wise: bool = False):
    """The ratio t from the task vectors; the blend of the base and the models' mean."""
    b = base.float()
    ws = [task_value(base, t) for t in tasks]
    deltas = [task_vector(base, t) for t in tasks]
    if filter_wise:
        rows = [_rows(d) for d in deltas]
        ts = [stock_ratio([d[r] for d in rows]) for r in range(rows[0].shape[0])]
        t = torch.tensor(ts, dtype=torch.float32).reshape(-1, 1)
        b, ws = _rows(b), [_rows(w) for w in ws]
    else:
        t = torch.tensor(stock_ratio(deltas), dtype=torch.float32)
    average = sum(ws) / torch.tensor(float(len(ws)))
    return (t * average + (1 - t) * b).reshape(base.shape)


# ---------------------------------------------------------------- sce


def sce(base: torch.Tensor, tasks: list[torch.Tensor], select_topk: float = 1.0):
    b = base.float()
    deltas = [task_vector(base, t) for t in tasks]
    n = len(deltas)
    if select_topk < 1:
        var = torch.var(torch.stack(deltas), dim=0, unbiased=False).reshape(-1)
        nonzero = int((var != 0).sum())
        k = min(int(f32(f32(nonzero) * f32(select_topk))), var.numel())
        values = var.tolist()
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        mask = torch.zeros(len(values), dtype=torch.float32)
        mask[order[:k]] = 1
        deltas = [d * mask.reshape(d.shape) for d in deltas]
    means = [dot(d, d) / d.numel() for d in deltas]
    total = fsum(means)
    if abs(total) < 1e-6:
        weights = [f32(1 / n)] * n
    else:
        weights = [f32(m / total) for m in means]
    sign_sum = torch.zeros_like(b)
    for d in deltas:
        sign_sum = sign_sum + d
    majority = torch.where(sign_sum >= 0, 1.0, -1.0)
    merged = torch.zeros_like(b)
    divisor = torch.zeros_like(b)
    for d, w in zip(deltas, weights, strict=True):
        kept = torch.tensor(w, dtype=torch.float32) * (d.sign() == majority).float()
        merged = merged + d * kept
        divisor = divisor + kept
    return b + merged / divisor.clamp(min=1e-6)


# ---------------------------------------------------------------- arcee_fusion


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(x - top) for x in row]
    s = fsum(e)
    return [v / s for v in e]


def arcee_kl_float64(base_row: list[float], task_row: list[float]) -> float:
    """The KL of one row in float64: `sum p log(p / q)`, p and q the rows' softmax + 1e-8."""
    p = [v + 1e-8 for v in _softmax(task_row)]
    q = [v + 1e-8 for v in _softmax(base_row)]
    return fsum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))


def arcee_kl(base_row: list[float], task_row: list[float]) -> float:
    """The KL of one row in float64, rounded to float32 once."""
    return f32(arcee_kl_float64(base_row, task_row))


def arcee_importance(base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    a, b = _rows(base.float()), _rows(task.float())
    kl = [arcee_kl(ar, br) for ar, br in zip(a.tolist(), b.tolist(), strict=True)]
    return (b - a).abs() * torch.tensor(kl, dtype=torch.float32).reshape(-1, 1)


def arcee_fusion(base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    a, b = base.float(), task_value(base, task)
    importance = arcee_importance(a, b).reshape(-1)
    ordered = sorted(importance.tolist())
    n = len(ordered)
    q1, median, q3 = (torch.tensor(ordered[(i * (n - 1)) // 4]) for i in (1, 2, 3))
    threshold = median + 1.5 * (q3 - q1)
    mask = (importance >= threshold).float().reshape(a.shape)
    return a + (b - a) * mask


#: The unit roundoff of float32.
U32 = 2.0**-24
#: Bounds on the relative error of torch's float32 exp and log on the CPU, whichever vector
#: width its kernels take: ATen's `exp_u20` is within 20 ulps, Sleef's `logf_u10` within 1
#: ulp (an ulp is at most 2 U32 of the value); doubled for margin.
EXP_ERROR, LOG_ERROR = 80 * U32, 4 * U32


def _gamma(k: int) -> float:
    """The bound on the relative error of a float32 sum of k + 1 terms of one sign, or of
    their absolute values, in any order (Higham's gamma_k)."""
    return k * U32 / (1 - k * U32)


def _softmax_error(row: list[float]) -> list[float]:
    """Per element, a bound on the relative error of `softmax(row) + 1e-8` computed in
    float32 by torch (x - max, exp, a sum in any order, the division, the addition)."""
    top = max(row)
    n = len(row)
    return [abs(x - top) * U32 + EXP_ERROR + _gamma(n - 1) + 4 * U32 for x in row]


def arcee_kl_float32_error(base_row: list[float], task_row: list[float]) -> float:
    """A bound on |mergekit's KL of a row - the exact KL|: mergekit's float32 softmax, the
    ratio, log, products and sum, whatever order torch's sums take (it depends on the CPU's
    vector width) and whichever exp and log kernels it uses. First-order terms, times 1.01."""
    p = [v + 1e-8 for v in _softmax(task_row)]
    q = [v + 1e-8 for v in _softmax(base_row)]
    ap, aq = _softmax_error(task_row), _softmax_error(base_row)
    bound = 0.0
    magnitude = 0.0
    for pi, qi, ei, fi in zip(p, q, ap, aq, strict=True):
        log = abs(math.log(pi / qi))
        # the ratio's log: both errors, the division; then the log, the product, p's error
        bound += pi * ((ei + fi + U32) + (LOG_ERROR + U32 + ei) * log)
        magnitude += pi * log
    return 1.01 * (bound + _gamma(len(p) - 1) * magnitude)


def arcee_settled(base: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    """Where mergekit's arcee_fusion must choose what the exact algorithm chooses, whatever
    its float32 KL's rounding: the elements whose importance, with each row's KL anywhere
    within `arcee_kl_float32_error` of the exact one, stays on one side of every threshold
    those importances can give. A boolean tensor of `base`'s shape."""
    a, b = base.float(), task_value(base, task)
    rows_a, rows_b = _rows(a), _rows(b)
    kl, err = [], []
    for ar, br in zip(rows_a.tolist(), rows_b.tolist(), strict=True):
        kl.append(arcee_kl_float64(ar, br))
        err.append(arcee_kl_float32_error(ar, br) + 1e-12 * abs(kl[-1]))
    kl64 = torch.tensor(kl, dtype=torch.float64).reshape(-1, 1)
    err64 = torch.tensor(err, dtype=torch.float64).reshape(-1, 1)
    diff = (rows_b - rows_a).abs().double()  # exact in float32, as mergekit's
    low = diff * (kl64 - err64)
    high = diff * (kl64 + err64)
    low, high = low - low.abs() * U32, high + high.abs() * U32  # the product's rounding
    low, high = low.reshape(-1), high.reshape(-1)
    n = low.numel()
    lows, highs = sorted(low.tolist()), sorted(high.tolist())
    lo = [lows[(i * (n - 1)) // 4] for i in (1, 2, 3)]  # each quartile's least and most
    hi = [highs[(i * (n - 1)) // 4] for i in (1, 2, 3)]
    # mergekit's threshold, median + 1.5 (q3 - q1), in float32: three roundings
    spread = 4 * U32 * (max(abs(lo[1]), abs(hi[1])) + 1.5 * (abs(hi[2]) + abs(hi[0])))
    least = lo[1] + 1.5 * (lo[2] - hi[0]) - spread
    most = hi[1] + 1.5 * (hi[2] - lo[0]) + spread
    return ((low > most) | (high < least)).reshape(a.shape)


def merge(method: str, base: State, tasks: list[State], params: dict | None = None) -> State:
    """The reference's merge of whole checkpoints (float32 out): per tensor `method`."""
    params = params or {}
    out = {}
    for name, b in base.items():
        ts = [t[name] for t in tasks]
        if method == "nearswap":
            out[name] = nearswap(b, ts[0], params["t"])
        elif method == "passthrough":
            out[name] = passthrough(ts[0], params.get("scale", 1.0))
        elif method == "model_stock":
            out[name] = model_stock(b, ts, params.get("filter_wise", False))
        elif method == "sce":
            out[name] = sce(b, ts, params.get("select_topk", 1.0))
        elif method == "arcee_fusion":
            out[name] = arcee_fusion(b, ts[0])
        else:
            raise ValueError(method)
    return out
