"""Prefix cache: full KV blocks found again by a hash of everything before and in them.

A full block is named by a hash chained over its parent block's hash and its own token ids, so
equal hashes mean (almost surely) equal prefixes. "Almost" is not enough to serve a learner's
tokens, so each registered block also keeps its *key*: its token ids and a link to the exact
physical parent block it was computed after (``(parent_block, parent_generation)``, or the
sequence's extra key for a first block). A lookup is a hit only when the stored key equals the
asked one; by induction over the chain the whole prefix is then identical, whatever the hash did.

Blocks that no sequence holds any more stay registered and *evictable*: they are reused on a hit
and taken back, least recently released first, only when an allocation needs the space.
"""
from __future__ import annotations

from collections import OrderedDict
from hashlib import blake2b
from typing import Callable, Hashable

from labkit import check_positive_int

HashFn = Callable[[bytes, bytes], bytes]
BlockKey = tuple  # (link, token_bytes); link is bytes (extra key) or (parent_block, generation)


def block_hash(parent_hash: bytes, token_bytes: bytes) -> bytes:
    """Stable across processes and machines (unlike Python's ``hash``): 16 bytes of BLAKE2b."""
    return blake2b(parent_hash + token_bytes, digest_size=16).digest()


def extra_key_bytes(extra_key: str | bytes | None) -> bytes:
    """A cache salt (tenant, LoRA, image...): prompts with different keys never share blocks."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, str):
        return extra_key.encode()
    if isinstance(extra_key, bytes):
        return extra_key
    raise ValueError(f"extra_key must be str, bytes or None, got {type(extra_key).__name__}")


def root_hash(extra: bytes) -> bytes:
    """The 'parent hash' of a sequence's first block."""
    return blake2b(b"labkit-root:" + extra, digest_size=16).digest()


def check_block_id(block, num_blocks: int) -> int:
    """``block`` as a block id in [0, num_blocks), or an error that says so: list indexing would
    wrap -1 to the last block, and a bool or a float would pass for an int."""
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block must be an int block id, got {type(block).__name__} {block!r}")
    if not 0 <= block < num_blocks:
        raise ValueError(f"block {block} is outside [0, {num_blocks}): the cache has "
                         f"{num_blocks} blocks")
    return block


class PrefixCache:
    """Hash table of full blocks plus the LRU list of those no sequence holds.

    The block manager owns ref counts and the free list; this class only knows which blocks are
    registered (findable by hash) and, among them, which are evictable and in what order.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = check_positive_int("num_blocks", num_blocks,
                                             hint="KV blocks in the cache")
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first

    def lookup(self, h: bytes, key: BlockKey) -> int | None:
        """The block registered under ``h`` if its stored key confirms it, else None."""
        block = self._by_hash.get(h)
        if block is None or self._key_of[block] != key:
            return None
        return block

    def _block(self, block) -> int:
        return check_block_id(block, self.num_blocks)

    def register(self, block: int, h: bytes, key: BlockKey) -> bool:
        """Make a just-filled block findable. The first block with a hash keeps it."""
        self._block(block)
        if self._hash_of[block] is not None:  # a second hash would leave the first one stale
            raise ValueError(f"block {block} is already registered; evict or forget it before "
                             "registering new contents")
        if h in self._by_hash:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        self._key_of[block] = key
        return True

    def is_registered(self, block: int) -> bool:
        return self._hash_of[self._block(block)] is not None

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of[self._block(block)]

    def park(self, block: int) -> None:
        """The last holder let go: keep the contents, evictable, most recently released last."""
        if not self.is_registered(block):  # evict() could not unregister it later
            raise ValueError(f"park({block}): the block is not registered; only registered "
                             "blocks wait to be hit again (free an unregistered one instead)")
        self._evictable[block] = None

    def revive(self, block: int) -> None:
        """A hit on an evictable block: it is in use again."""
        if not self.is_evictable(block):
            raise ValueError(f"revive({block}): the block is not evictable (no park() since it "
                             "was last in use)")
        del self._evictable[block]

    def is_evictable(self, block: int) -> bool:
        return self._block(block) in self._evictable

    def evict(self) -> int:
        """Forget the least recently released block and hand it back for new contents."""
        if not self._evictable:
            raise ValueError("evict(): no block is evictable (every registered block is in "
                             "use); check num_evictable() first")
        block, _ = self._evictable.popitem(last=False)
        h = self._hash_of[block]
        del self._by_hash[h]
        self._hash_of[block] = None
        self._key_of[block] = None
        return block

    def forget(self, block: int) -> None:
        """Unregister a block no sequence holds whose contents cannot be trusted (the step that
        was to write them failed); the block manager frees it."""
        self._evictable.pop(self._block(block), None)
        h = self._hash_of[block]
        if h is not None:
            del self._by_hash[h]
            self._hash_of[block] = None
            self._key_of[block] = None

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (next to go first)."""
        return list(self._evictable)

    def num_evictable(self) -> int:
        return len(self._evictable)

    def snapshot(self) -> tuple[Hashable, ...]:
        return (tuple(sorted(self._by_hash.items())), tuple(self._hash_of), tuple(self._key_of),
                tuple(self._evictable))
