"""Imported by every worker process of an embedded Ray as it starts, before it takes a task
(Ray's `preload_python_modules`, which `runtime.ray_session` sets when it starts Ray): the
passes' task modules, the methods, the kernels' modules and numba's registries
(`worker.warm_up`), and Ray's serialization context (`ray_private.serialization_ready`),
made while Ray still starts instead of in the first task's way. Runs on Ray workers.

Importing this module is the work. It never raises: Ray lets a worker whose preload raised
anything but an ImportError die, and the first task loads the same again anyway.
"""

from __future__ import annotations

import logging

try:
    from ram_dist.engine import map_step, pool, ray_private, reduce_step  # noqa: F401
    from ram_dist.engine.worker import warm_up

    warm_up()
    ray_private.serialization_ready()
except Exception:  # noqa: BLE001  (never fail a worker's start: its first task loads this too)
    logging.getLogger(__name__).debug("preloading the worker failed", exc_info=True)
