"""ram-dist: exact, distributed Reinforced Agent Merging (RAM, RAM+) of safetensors checkpoints.

From Python: `ram_dist.merge(...)`, `ram_dist.probe(...)`, `ram_dist.plan(...)` and
`ram_dist.verify(...)` (`ram_dist.api`), loaded on first use so that importing the package
(and `ram-dist --help`) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from ram_dist.errors import RamDistError  # noqa: E402

#: The public API, `ram_dist.api`'s names, loaded on first use.
API = (
    "MergeReport",
    "PlanReport",
    "ProbeReport",
    "Report",
    "VerifyResult",
    "job_config",
    "merge",
    "plan",
    "probe",
    "run_merge",
    "run_plan",
    "run_probe",
    "verify",
)

__all__ = ["RamDistError", "__version__", *API]

if TYPE_CHECKING:  # what type checkers and IDEs see: the calls' own signatures
    from ram_dist.api import (  # noqa: F401  (exported: `__all__`)
        MergeReport,
        PlanReport,
        ProbeReport,
        Report,
        VerifyResult,
        job_config,
        merge,
        plan,
        probe,
        run_merge,
        run_plan,
        run_probe,
        verify,
    )


def __getattr__(name: str) -> Any:
    if name in API:
        from ram_dist import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
