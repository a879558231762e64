"""Notebook 05: contiguous against paged KV memory (memory), what one token's KV costs per
attention scheme, MHA, GQA and MLA (attention_memory), fp8 cache scales per tensor or per head
and what a stale one clips (fp8_scales), the block map as requests grow, fork and finish
(block_map), prefix caching's hits and evictions (prefix_workload), the time to first token a
hit saves, timed through the engine in interleaved rounds (prefix_ttft), and the sentences the
notebook claims from those numbers (claims)."""
