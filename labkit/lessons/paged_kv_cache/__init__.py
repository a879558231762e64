"""Notebook 05: contiguous against paged KV memory (memory), the block map as requests grow,
fork and finish (block_map), prefix caching's hits and evictions (prefix_workload), and the
sentences the notebook claims from those numbers (claims)."""
