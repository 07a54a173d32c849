"""`python -m ram_dist.cli`: the `ram-dist` command, where the executable is not installed."""

from ram_dist.cli import run

run()
