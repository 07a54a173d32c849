"""Storage: safetensors headers and byte ranges over fsspec, shard and index writing."""
