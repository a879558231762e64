"""DeepSeek-V3's MLA widths the lesson and its benchmarks measure at."""
RANK, ROPE, BLOCK = 512, 64, 64  # kv_lora_rank, qk_rope_head_dim, and the paged cache's block
SCALE = (128 + 64) ** -0.5       # its softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
