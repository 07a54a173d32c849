"""Every method of `ram_dist.methods.registry` as `bench_methods` runs it: which of the
benchmark's checkpoints it merges and with which parameters, written as one mergekit-style
YAML that both tools read (ram-dist takes mergekit's schema), so the two compute the same
merge. Where mergekit names the method otherwise or lacks it, `mergekit` says so."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.inputs import model_names

#: The pseudo-method of three rank-16 LoRA adapters of the base, merged with ram_plus.
LORA = "lora_r16"
LORA_RANK = 16


@dataclass(frozen=True)
class Spec:
    """One method's merge.

    `agents`: how many of the agents it merges; `base`: whether the base is the base model
    (methods without one merge the agents alone); `top` and `each`: the parameters (`each`
    one dict for every model, or a list of one per model); `mergekit`: mergekit's method of
    the same merge (None: mergekit has none) and `mergekit_top` its parameters where they
    differ from `top` (RAM+ against mergekit's `ram`, which takes only epsilon)."""

    agents: int
    base: bool = True
    top: dict[str, Any] = field(default_factory=dict)
    each: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)
    mergekit: str | None = ""
    mergekit_top: dict[str, Any] | None = None

    def mergekit_name(self, method: str) -> str | None:
        return method if self.mergekit == "" else self.mergekit


_RAM = {"epsilon": 1e-5}
_RAM_PLUS = {"r": 0.1, "alpha": 2.0, "epsilon": 1e-5}
_SPARSE = {"density": 0.5, "weight": 1.0}
_DELLA = {"density": 0.5, "epsilon": 0.1, "weight": 1.0}
_CRUMBS = {"density": 0.9, "gamma": 0.01, "weight": 1.0}
_LAMBDA = {"lambda": 1.0}

METHODS: dict[str, Spec] = {
    # the targets first: a run stopped early still has them
    "ram_plus": Spec(3, top=_RAM_PLUS, mergekit="ram", mergekit_top=_RAM),
    "ties": Spec(3, top=_LAMBDA | {"normalize": True}, each=_SPARSE),
    "slerp": Spec(1, top={"t": 0.3}),
    "model_stock": Spec(3),
    "della": Spec(3, top=_LAMBDA, each=_DELLA),
    LORA: Spec(3, top=_RAM_PLUS, mergekit="ram", mergekit_top=_RAM),
    "task_arithmetic": Spec(3, top=_LAMBDA, each={"weight": 1.0}),
    "ram": Spec(3, top=_RAM),
    "ramplus_tl": Spec(3, top={"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}),
    "ram_plus_soft": Spec(3, top=_RAM_PLUS, mergekit=None),
    "dare_linear": Spec(3, top=_LAMBDA, each=_SPARSE),
    "dare_ties": Spec(3, top=_LAMBDA, each=_SPARSE),
    "consensus_ta": Spec(3, top=_LAMBDA, each={"weight": 1.0}, mergekit=None),
    "consensus_ties": Spec(3, top=_LAMBDA, each=_SPARSE, mergekit=None),
    "breadcrumbs": Spec(3, top=_LAMBDA, each=_CRUMBS),
    "breadcrumbs_ties": Spec(3, top=_LAMBDA, each=_CRUMBS),
    "della_linear": Spec(3, top=_LAMBDA, each=_DELLA),
    "linear": Spec(3, base=False, top={"normalize": True}, each={"weight": 1.0}),
    "sce": Spec(3, top={"select_topk": 0.5}),
    "arcee_fusion": Spec(1),
    "nearswap": Spec(1, top={"t": 0.01}),
    "passthrough": Spec(1, base=False, each={"scale": 1.0}),
    "nuslerp": Spec(2, each=[{"weight": 0.3}, {"weight": 0.7}]),
    "multislerp": Spec(3, each={"weight": 1.0}),
    "karcher": Spec(3, base=False),
}


def agents(models_dir: Path, method: str) -> list[Path]:
    """The agents `method` merges, in order."""
    return [models_dir / n for n in model_names()[1 : 1 + METHODS[method].agents]]


def config(method: str, models_dir: Path, tasks: list[Path], tool: str) -> dict[str, Any]:
    """The YAML of `method` on `tasks` for `tool` (`ramdist` or `mergekit`): `dtype: float32`
    because ram-dist computes in float32, `out_dtype: bfloat16`, the inputs' dtype."""
    spec = METHODS[method]
    name = "ram_plus" if method == LORA else method
    top = spec.top
    if tool == "mergekit":
        name, top = spec.mergekit_name(method) or name, spec.mergekit_top or spec.top
    each = spec.each if isinstance(spec.each, list) else [spec.each] * len(tasks)
    models = [
        {"model": str(t), **({"parameters": dict(p)} if p else {})}
        for t, p in zip(tasks, each, strict=True)
    ]
    out: dict[str, Any] = {"merge_method": name}
    if spec.base:
        out["base_model"] = str(models_dir / "base")
    out["models"] = models
    if top:
        out["parameters"] = dict(top)
    return out | {"dtype": "float32", "out_dtype": "bfloat16"}
