"""Paged KV cache: the block manager (allocation, ref counts, copy-on-write, fork), the prefix
cache (chained block hashes, LRU eviction) and the KV tensors written by a Triton kernel."""
from labkit.kvcache.block_manager import BlockManager, CacheStats, OutOfBlocks
from labkit.kvcache.paged_kv_cache import (
    KVCacheShape, PagedKVCache, kv_cache_bytes, memory_table, tokens_that_fit,
)
from labkit.kvcache.prefix_cache import PrefixCache, block_hash

__all__ = [
    "BlockManager", "CacheStats", "KVCacheShape", "OutOfBlocks", "PagedKVCache", "PrefixCache",
    "block_hash", "kv_cache_bytes", "memory_table", "tokens_that_fit",
]
