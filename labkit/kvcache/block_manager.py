"""Block manager: which fixed-size KV blocks each sequence holds, shared where it can be.

A sequence of n tokens holds ``ceil(n / block_size)`` blocks, listed in its ``block_table``;
token ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
Blocks are shared two ways, and a ``ref_count`` per block says by how many tables:

- prefix caching: a prompt's full blocks are looked up in the :class:`PrefixCache`; a confirmed
  hit is reused instead of recomputed. Only full blocks are shared this way, and a lookup always
  leaves at least one prompt token to compute (the model needs it for the next token's logits).
- ``fork``: a child (a beam, a parallel sample) shares every block of its parent, including a
  partly filled last block. The first ``append_token`` into such a shared block copies it
  (copy-on-write) and returns ``(src, dst)`` for the caller to copy in the KV tensors.

Speculative decoding's draft tokens get slots but seal no block until they are accepted, so
the prefix cache never finds a rejected token (``append_draft``, ``accept_draft``: see
``kvcache/draft_tokens.py``).

A block is released when its ref count drops to zero: to the free list, or, if registered in the
prefix cache, to its evictable list, where it waits to be hit again or evicted (LRU) for space.
Every operation checks it can finish before it changes anything: on :class:`OutOfBlocks` or a
``ValueError`` the manager is exactly as before the call (``kvcache/refusals.py``).
"""
from __future__ import annotations

from array import array
from typing import Hashable, Sequence

from labkit import check_positive_int, check_power_of_two
from labkit.kvcache.cache_stats import CacheStats
from labkit.kvcache.draft_tokens import DraftTokens
from labkit.kvcache.prefix_cache import (
    HashFn, PrefixCache, block_hash, check_block_id, extra_key_bytes, root_hash,
)
from labkit.kvcache.refusals import OutOfBlocks, check_token_id, token_bytes


class _Sequence:
    __slots__ = ("block_table", "num_tokens", "tail", "last_hash", "extra", "pending",
                 "num_draft", "capacity")

    def __init__(self, block_table, num_tokens, tail, last_hash, extra):
        self.block_table: list[int] = block_table
        self.num_tokens: int = num_tokens
        self.tail: list[int] = tail          # token ids in the partly filled last block
        self.last_hash: bytes = last_hash    # hash of the last full block (chain parent)
        self.extra: bytes = extra
        self.pending: bool = False           # the last token's id is not known yet
        self.num_draft: int = 0              # trailing tokens awaiting verification
        self.capacity: int = 0               # tokens whose blocks are held ahead (``reserve``)


class BlockManager(DraftTokens):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 hash_fn: HashFn = block_hash):
        check_positive_int("num_blocks", num_blocks, hint="KV blocks in the cache")
        check_power_of_two("block_size", block_size, hint="tokens a block holds; 16 is usual")
        if not isinstance(enable_prefix_caching, bool):  # bool("no") is True
            raise TypeError(f"enable_prefix_caching must be True or False, got "
                            f"{enable_prefix_caching!r}")
        if not callable(hash_fn):
            raise TypeError(f"hash_fn must be a function (parent_hash, token_bytes) -> bytes, "
                            f"got {hash_fn!r}; leave it out for block_hash")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self._mask = block_size - 1
        self._ref = [0] * num_blocks
        self._gen = [0] * num_blocks           # bumped each time a block gets new contents
        self._free = list(range(num_blocks - 1, -1, -1))   # a stack: block 0 is taken first
        self._prefix = PrefixCache(num_blocks)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._hits = self._misses = self._evictions = self._hit_tokens = self._prompt_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: free ones plus evictable cached ones."""
        return len(self._free) + self._prefix.num_evictable()

    @property
    def stats(self) -> CacheStats:
        cached = self._prefix.num_evictable()
        free = len(self._free)
        return CacheStats(self._hits, self._misses, self._evictions, self._hit_tokens,
                          self._prompt_tokens, self.num_blocks - cached - free, cached, free)

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).block_table)

    def num_tokens(self, seq_id) -> int:
        """Tokens holding slots, draft tokens included."""
        return self._get(seq_id).num_tokens

    def ref_count(self, block: int) -> int:
        return self._ref[check_block_id(block, self.num_blocks)]

    def is_cached(self, block: int) -> bool:
        """Registered in the prefix cache (findable by hash), whether in use or evictable."""
        return self._prefix.is_registered(check_block_id(block, self.num_blocks))

    def evictable_blocks(self) -> list[int]:
        """Cached blocks no sequence holds, next to be evicted first."""
        return self._prefix.evictable_blocks()

    def slots(self, seq_id, start: int, end: int) -> list[int]:
        """slot_mapping entries of token positions ``[start, end)`` of a sequence."""
        seq = self._get(seq_id)
        for name, p in (("start", start), ("end", end)):
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(f"slots: {name} must be an int token position, got "
                                f"{type(p).__name__} {p!r}")
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r} "
                             f"of {seq.num_tokens} tokens")
        table, bs = seq.block_table, self.block_size
        slots, p = [], start
        while p < end:  # a block's positions are consecutive slots: one range per block
            block, stop = p // bs, min(end, (p // bs + 1) * bs)
            first = table[block] * bs + (p & self._mask)
            slots.extend(range(first, first + stop - p))
            p = stop
        return slots

    def can_append(self, seq_id) -> bool:
        return self._blocks_to_append(self._get(seq_id)) <= self.num_free_blocks

    def can_allocate(self, token_ids: Sequence[int], *, extra_key=None) -> bool:
        hits, _, _ = self._match(token_ids, extra_key_bytes(extra_key))
        return self._blocks_to_allocate(len(token_ids), hits) <= self._available_after(hits)

    def cached_prefix_len(self, token_ids: Sequence[int], *, extra_key=None) -> int:
        """Leading tokens of this prompt the prefix cache would serve now (read-only: no
        counters, no LRU order change). Always leaves at least one token to compute."""
        hits, _, _ = self._match(token_ids, extra_key_bytes(extra_key))
        return len(hits) * self.block_size

    def snapshot(self) -> tuple:
        """Everything the manager holds, comparable with ``==`` (tests check nothing changed)."""
        seqs = tuple((k, tuple(s.block_table), s.num_tokens, tuple(s.tail), s.last_hash, s.extra,
                      s.pending, s.num_draft, s.capacity) for k, s in self._seqs.items())
        return (tuple(self._ref), tuple(self._gen), tuple(self._free), seqs,
                self._prefix.snapshot(), self.stats)

    # ------------------------------------------------------------------ operations
    def allocate(self, seq_id, token_ids: Sequence[int], *, extra_key=None) -> int:
        """Give a new sequence blocks for its prompt; returns how many leading tokens were served
        from the prefix cache (a multiple of block_size, always less than ``len(token_ids)``)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or use a "
                             "new seq_id")
        extra = extra_key_bytes(extra_key)
        hits, hashes, chunks = self._match(token_ids, extra)
        if len(token_ids) == 0:
            raise ValueError(f"allocate({seq_id!r}) got no tokens: a prompt needs at least one")
        n = len(token_ids)
        need = self._blocks_to_allocate(n, hits)
        available = self._available_after(hits)
        if need > available:
            raise OutOfBlocks(f"allocate({seq_id!r}, {n} tokens)", need, available,
                              self.num_blocks)

        prefix, ref = self._prefix, self._ref
        for b in hits:
            if ref[b] == 0:
                prefix.revive(b)
            ref[b] += 1
        table = hits + [self._take() for _ in range(need)]
        num_full = n // self.block_size
        if self.enable_prefix_caching:
            registered = True  # a block is findable only through a findable parent
            for i in range(len(hits), num_full):
                link = (table[i - 1], self._gen[table[i - 1]]) if i else extra
                registered = registered and prefix.register(table[i], hashes[i],
                                                            (link, chunks[i]))
        last_hash = hashes[-1] if hashes else root_hash(extra)
        tail = list(token_ids[num_full * self.block_size:]) if self.enable_prefix_caching else []
        self._seqs[seq_id] = _Sequence(table, n, tail, last_hash, extra)
        self._hits += len(hits)
        self._misses += need
        self._hit_tokens += len(hits) * self.block_size
        self._prompt_tokens += n
        return len(hits) * self.block_size

    def append_token(self, seq_id, token_id: int | None) -> list[tuple[int, int]]:
        """Make room for one more token; returns block copies ``(src, dst)`` to apply first.

        ``token_id=None``: the token is still being sampled on the device (async scheduling
        reserves its slot one step early). Its block is registered in the prefix cache only
        once ``set_token`` gives the id; until then the sequence takes no further token.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"append_token: unknown sequence {seq_id!r}; allocate it first")
        if seq.pending:
            raise ValueError(f"append_token({seq_id!r}): its last token is still pending; call "
                             "set_token with the sampled id first")
        self._check_no_draft(seq_id, seq, "append_token")
        if token_id is not None:
            token_id = check_token_id(token_id, "token_id")  # fails here, before anything changes
        pos = seq.num_tokens & self._mask
        copies = []
        table, i = seq.block_table, seq.num_tokens // self.block_size
        try:
            if pos == 0:
                if i == len(table):  # else a block held ahead (``reserve``) takes it
                    table.append(self._take())
            else:
                last = table[i]
                if self._ref[last] > 1:  # shared partial block (after fork): copy, then write
                    new = self._take()
                    self._ref[last] -= 1
                    table[i] = new
                    copies.append((last, new))
        except OutOfBlocks:
            raise OutOfBlocks(f"append_token({seq_id!r})", 1, 0, self.num_blocks) from None
        seq.num_tokens += 1
        if token_id is None:
            seq.pending = True
        if self.enable_prefix_caching:
            seq.tail.append(token_id)
            if pos == self._mask and token_id is not None:
                self._seal(seq, i)
        return copies

    def set_token(self, seq_id, token_id: int) -> None:
        """Give the id of a sequence's pending last token (see ``append_token``)."""
        seq = self._get(seq_id)
        if not seq.pending:
            raise ValueError(f"set_token({seq_id!r}): no pending token; append_token(seq_id, None) "
                             "reserves one")
        token_id = check_token_id(token_id, "token_id")
        if self.enable_prefix_caching:
            seq.tail[-1] = token_id
            if seq.num_tokens & self._mask == 0:  # the pending token filled its block
                self._seal(seq, seq.num_tokens // self.block_size - 1)
        seq.pending = False

    def has_pending(self, seq_id) -> bool:
        return self._get(seq_id).pending

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (ref counts go up; nothing is copied)."""
        parent = self._get(parent_id)
        if parent.pending:
            raise ValueError(f"fork: {parent_id!r} has a pending token; set_token first")
        self._check_no_draft(parent_id, parent, "fork")
        if parent.capacity:
            raise ValueError(f"fork: {parent_id!r} holds blocks ahead (reserve); resolve its "
                             "step and call release_reserve first")
        if child_id in self._seqs:
            raise ValueError(f"fork: child {child_id!r} already exists; pick a new seq_id")
        ref = self._ref
        for b in parent.block_table:
            ref[b] += 1
        self._seqs[child_id] = _Sequence(list(parent.block_table), parent.num_tokens,
                                         list(parent.tail), parent.last_hash, parent.extra)

    def free(self, seq_id, *, uncache: bool = False) -> None:
        """Release a sequence's blocks. Tail blocks are released first, so under pressure they
        are evicted before the prefix blocks that other prompts are likelier to share.

        ``uncache=True``: the blocks no other sequence holds leave the prefix cache as well,
        for a sequence whose step failed before its KV was written (a later prompt must not
        find blocks that hold nothing)."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self._release(seq.block_table, uncache)

    # ------------------------------------------------------------------ internals
    def _release(self, blocks: list[int], uncache: bool) -> None:
        ref, prefix = self._ref, self._prefix
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if prefix.is_registered(b) and not uncache:
                    prefix.park(b)
                else:
                    prefix.forget(b)
                    self._free.append(b)

    def _get(self, seq_id) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r} (known: {len(self._seqs)} "
                             "sequences); allocate it first")
        return seq

    def _take(self) -> int:
        """A block for new contents: a free one, else the least recently released cached one."""
        if self._free:
            b = self._free.pop()
        elif self._prefix.num_evictable():
            b = self._prefix.evict()
            self._evictions += 1
        else:
            raise OutOfBlocks("one more block", 1, 0, self.num_blocks)
        self._ref[b] = 1
        self._gen[b] += 1
        return b

    def _seal(self, seq: _Sequence, i: int) -> None:
        """Block ``i`` just became full of the tail's first block_size tokens, all known and
        accepted: register it so later prompts can find it."""
        tokens = array("q", seq.tail[:self.block_size]).tobytes()
        del seq.tail[:self.block_size]
        h = self._hash_fn(seq.last_hash, tokens)
        seq.last_hash = h
        table = seq.block_table
        if i == 0:
            self._prefix.register(table[0], h, (seq.extra, tokens))
        else:
            parent = table[i - 1]
            if self._prefix.is_registered(parent):
                self._prefix.register(table[i], h, ((parent, self._gen[parent]), tokens))

    def _match(self, token_ids, extra: bytes) -> tuple[list[int], list[bytes], list[bytes]]:
        """Confirmed cache hits for a prompt's leading full blocks, with every full block's hash
        and token bytes (needed to register the new ones). Bad token ids are refused here,
        with prefix caching on or off."""
        buf = token_bytes(token_ids)
        if not self.enable_prefix_caching:
            return [], [], []
        bs8 = self.block_size * 8
        num_full = len(token_ids) // self.block_size
        lookups = (len(token_ids) - 1) // self.block_size  # leave >= 1 token to compute
        hits, hashes, chunks = [], [], []
        h, link = root_hash(extra), extra
        hash_fn, lookup = self._hash_fn, self._prefix.lookup
        for i in range(num_full):
            chunk = buf[i * bs8:(i + 1) * bs8]
            h = hash_fn(h, chunk)
            hashes.append(h)
            chunks.append(chunk)
            if len(hits) == i < lookups:
                b = lookup(h, (link, chunk))
                if b is not None:
                    hits.append(b)
                    link = (b, self._gen[b])
        return hits, hashes, chunks

    def _blocks_to_allocate(self, num_tokens: int, hits: list[int]) -> int:
        return -(-num_tokens // self.block_size) - len(hits)

    def _available_after(self, hits: list[int]) -> int:
        """Blocks left for new contents once the hits that were evictable are taken back."""
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return self.num_free_blocks - revived

    def _blocks_to_append(self, seq: _Sequence) -> int:
        i = seq.num_tokens // self.block_size
        if seq.num_tokens & self._mask == 0:
            return 1 if i == len(seq.block_table) else 0
        return 1 if self._ref[seq.block_table[i]] > 1 else 0
