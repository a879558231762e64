"""The block manager's counters: what the prefix cache saved, and where every block is.

``BlockManager.stats`` returns one :class:`CacheStats`: hits, misses and evictions count blocks
since the manager was made; ``hit_rate`` is the share of prompt tokens whose KV was found
instead of computed; the last three fields split ``num_blocks`` by what holds each block now.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    hits: int             # prompt blocks served from the prefix cache
    misses: int           # prompt blocks that had to be allocated (and computed)
    evictions: int        # cached blocks taken back for new contents
    hit_tokens: int
    prompt_tokens: int
    blocks_in_use: int    # held by at least one sequence
    blocks_cached: int    # held by none, contents kept, evictable
    blocks_free: int

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens whose KV came from the cache."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
