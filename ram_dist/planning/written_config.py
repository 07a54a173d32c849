"""A job's `mergekit_config.yml`: what `mergekit_config.writing` writes, from the job."""

from __future__ import annotations

from ram_dist.mergekit_config.writing import effective_config
from ram_dist.mergekit_config.writing import render as render_config
from ram_dist.planning.job import Job

__all__ = ["render"]


def render(job: Job) -> str:
    """The file's text: the job's method, inputs and per-tensor parameters, resolved."""
    config = effective_config(
        job.method.name, job.config.base, job.config.tasks, job.params, job.config.out_dtype
    )
    return render_config(config, job.config.notes)
