"""The Ray driver and its two passes. Knows no math: methods come from `ram_dist.methods`."""
