"""mergekit's YAML configuration: read (`reading`), resolved per tensor (`resolving`), and
written back as what ran (`writing`).

Pure Python and PyYAML; no torch, no I/O except reading the YAML file. What a mergekit
configuration may say, for the methods ram-dist runs (`methods.parameters.PARAMETERS`)::

    merge_method: ties
    base_model: path/or/url/of/base
    models:
      - model: path/of/task1
        parameters: {weight: 0.7, density: [0.2, 0.5, 0.9]}
      - model: path/of/task2
        parameters:
          weight: [{filter: mlp, value: 0.3}, {value: 0.5}]
    parameters: {normalize: true, lambda: 1.0}
    dtype: float32
    out_dtype: bfloat16
    tokenizer_source: base
    storage_options: {s3: {endpoint_url: ...}}   # ram-dist's own: fsspec options per protocol
    device: auto                                  # ram-dist's own: auto, cpu or cuda

A parameter's value is a scalar, a list of numbers interpolated across the layers (a
"gradient"), or a list of `{filter, value}` entries whose filters are matched as substrings of
the tensor name (a value may itself be a gradient); `resolving` gives each tensor its value
exactly as mergekit 0.1.5 does. A method's per-task parameters (`weight`, `density`) may be set
per model and at the top level; its global ones (`normalize`, `lambda`, `rescale`, `r`,
`alpha`, `epsilon`, ...) only at the top level: mergekit ignores them under a model, and so
does ram-dist (with a note).

The output dtype is mergekit's: `out_dtype`, else `dtype` (what mergekit computed in and so
writes), else the CLI's default. ram-dist always computes in float32, with a note when `dtype`
says otherwise.

Anything mergekit accepts but ignores is accepted and ignored here too, with a note in
`JobSpec.notes` (e.g. `int8_mask`, which only changes the dtype of mergekit's sign mask). What
ram-dist cannot do (`slices`, `modules`, other tokenizer sources, ...) is a `RamDistError`
that names the key.
"""

from __future__ import annotations

from ram_dist.io.names import MERGEKIT_CONFIG_NAME as CONFIG_NAME
from ram_dist.mergekit_config import spec
from ram_dist.mergekit_config.reading import (
    TOP_KEYS,
    load_mergekit_yaml,
    parse_mergekit_config,
    parse_setting,
)
from ram_dist.mergekit_config.resolving import (
    REQUIRED,
    first_value,
    num_layers,
    position,
    resolve,
    resolve_parameter,
    resolve_tensor,
)
from ram_dist.mergekit_config.spec import *  # noqa: F403  (`spec.__all__`)
from ram_dist.mergekit_config.writing import effective_config, render
from ram_dist.methods.decoder_layers import layer_index

__all__ = [
    "CONFIG_NAME",
    "REQUIRED",
    "TOP_KEYS",
    "effective_config",
    "first_value",
    "layer_index",
    "load_mergekit_yaml",
    "num_layers",
    "parse_mergekit_config",
    "parse_setting",
    "position",
    "render",
    "resolve",
    "resolve_parameter",
    "resolve_tensor",
    *spec.__all__,
]
