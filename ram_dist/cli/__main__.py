"""`python -m ram_dist.cli`: the `ram-dist` command, where the executable is not installed."""

from ram_dist.cli import run

if __name__ == "__main__":  # not when a tool imports every module (pkgutil.walk_packages)
    run()
