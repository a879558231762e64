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


class PrefixCache:
    """Hash table of full blocks plus the LRU list of those no sequence holds.

    The block manager owns ref counts and the free list; this class only knows which blocks are
    registered (findable by hash) and, among them, which are evictable and in what order.
    """

    def __init__(self, num_blocks: int):
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

    def register(self, block: int, h: bytes, key: BlockKey) -> bool:
        """Make a just-filled block findable. The first block with a hash keeps it."""
        if h in self._by_hash:
            return False
        self._by_hash[h] = block
        self._hash_of[block] = h
        self._key_of[block] = key
        return True

    def is_registered(self, block: int) -> bool:
        return self._hash_of[block] is not None

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of[block]

    def park(self, block: int) -> None:
        """The last holder let go: keep the contents, evictable, most recently released last."""
        self._evictable[block] = None

    def revive(self, block: int) -> None:
        """A hit on an evictable block: it is in use again."""
        del self._evictable[block]

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evict(self) -> int:
        """Forget the least recently released block and hand it back for new contents."""
        block, _ = self._evictable.popitem(last=False)
        h = self._hash_of[block]
        del self._by_hash[h]
        self._hash_of[block] = None
        self._key_of[block] = None
        return block

    def forget(self, block: int) -> None:
        """Unregister a block no sequence holds whose contents cannot be trusted (the step that
        was to write them failed); the block manager frees it."""
        self._evictable.pop(block, None)
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
