"""A job's `mergekit_config.yml`: what `mergekit_config.writing` writes, from the job."""

from __future__ import annotations

from ram_dist.mergekit_config.writing import effective_config
from ram_dist.mergekit_config.writing import render as render_config
from ram_dist.planning.job import Job

__all__ = ["render"]


def render(job: Job) -> str:
    """The file's text: the job's method, inputs and per-tensor parameters, resolved; an
    adapter task written `BASE+ADAPTER`, as mergekit reads it."""
    base = job.config.base
    tasks = [  # an adapter as mergekit names it: the base with the adapter applied
        f"{base}+{url}" if ckpt.adapter is not None else url
        for url, ckpt in zip(job.config.tasks, job.tasks, strict=True)
    ]
    config = effective_config(job.method.name, base, tasks, job.params, job.config.out_dtype)
    return render_config(config, job.config.notes)
