"""Benchmarks of ram-dist, run as modules from the repository root, e.g.
`python -m benchmarks.bench_merge --help` (see benchmarks/README.md).

`inputs` generates the synthetic checkpoints (with `ram_dist.synthetic`), `running` runs and
times the commands, `reporting` prints the tables; the `bench_*` modules are the entry points.
"""
