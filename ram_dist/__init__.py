"""ram-dist: exact, distributed Reinforced Agent Merging (RAM, RAM+) of safetensors checkpoints."""

__version__ = "0.1.0"

from ram_dist.errors import RamDistError  # noqa: E402

__all__ = ["RamDistError", "__version__"]
