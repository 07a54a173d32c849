"""Every file name ram-dist reads in a checkpoint or writes in an output, in one table, so
that the writer, the reader, `verify`, the resume check and the model card agree on them."""

from __future__ import annotations

#: A sharded checkpoint's index, and a single-file checkpoint's weights.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: A PEFT adapter folder's config and weights (`PeftModel.save_pretrained`), and the pickle
#: it may hold instead, which is never opened.
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"
#: The model's own config (its dtype is rewritten to the output dtype).
MODEL_CONFIG_NAME = "config.json"
#: What a merge writes beside the shards: the manifest (resume, verify), the report, the
#: model card, and the effective mergekit configuration.
MANIFEST_NAME = "ram_dist_manifest.json"
REPORT_NAME = "merge_report.json"
CARD_NAME = "README.md"
MERGEKIT_CONFIG_NAME = "mergekit_config.yml"
#: What a sweep writes in its folder beside its variants' folders (`docs/sweeps.md`).
SWEEP_REPORT_NAME = "sweep_report.json"
#: A sweep's variants, written before any of their folders: a rerun resumes only the same.
SWEEP_MANIFEST_NAME = "ram_dist_sweep.json"
#: The output's lease (claimed before anything is written), and the suffix of a file being
#: written (renamed into place when complete).
LEASE_NAME = ".ram-dist-lease.json"
PARTIAL_SUFFIX = ".ram-dist-partial"
#: The start of the empty file a run writes and removes at once to learn that it may write
#: to an output store (one name per run, so that two runs never remove each other's).
WRITE_CHECK_PREFIX = ".ram-dist-write-check"
#: Files that say a checkpoint carries its tokenizer (the model card mentions it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: What `probe` writes beside its JSON report STEM.json: STEM plus each suffix.
PROBE_SUFFIXES = (".figure2.png", ".layers.csv", ".layers.png")


def probe_files(json_path: str) -> list[str]:
    """The probe's JSON report and, beside it, its figure, per-layer table and heatmap."""
    stem = json_path[: -len(".json")] if json_path.endswith(".json") else json_path
    return [json_path, *(stem + suffix for suffix in PROBE_SUFFIXES)]
