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

Speculative decoding writes KV for draft tokens that the target model may reject.
``append_draft`` gives them slots (blocks, copy-on-write) but never seals a block holding one:
only ``accept_draft`` commits the accepted ones (sealing the blocks they fill) and rolls the
rest back, releasing blocks past the new end. So the prefix cache never finds a rejected token.

A block is released when its ref count drops to zero: to the free list, or, if registered in the
prefix cache, to its evictable list, where it waits to be hit again or evicted (LRU) for space.
Every operation checks it can finish before it changes anything: on :class:`OutOfBlocks` or a
``ValueError`` the manager is exactly as before the call.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from operator import index
from typing import Hashable, Sequence

from labkit import check_positive_int, check_power_of_two
from labkit.kvcache.prefix_cache import (
    HashFn, PrefixCache, block_hash, check_block_id, extra_key_bytes, root_hash,
)


TOKEN_IDS = "token ids must be ints (a tokenizer's output)"


def _token_id(token_id, where: str) -> int:
    """One token id as an int; the same refusal with prefix caching on or off."""
    if isinstance(token_id, bool):
        raise TypeError(f"{TOKEN_IDS}: {where} is a bool ({token_id}); pass the id itself")
    try:
        token_id = index(token_id)
    except TypeError:
        raise TypeError(f"{TOKEN_IDS}: {where} is {type(token_id).__name__} {token_id!r}") \
            from None
    if not -2**63 <= token_id < 2**63:
        raise ValueError(f"{TOKEN_IDS} in [-2**63, 2**63): {where} is {token_id}")
    return token_id


def _token_bytes(token_ids) -> bytes:
    """A prompt's token ids packed as int64, or the error that names the first bad one."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}: "
                        "pass list(...) of the tokenizer's ids")
    try:
        if any(t.__class__ is bool for t in token_ids):
            raise TypeError
        return array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        for i, t in enumerate(token_ids):
            _token_id(t, f"token_ids[{i}]")
        raise


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; nothing was changed."""

    def __init__(self, what: str, needed: int, available: int, num_blocks: int):
        self.needed, self.available = needed, available
        super().__init__(
            f"{what} needs {needed} new block(s) but only {available} of {num_blocks} are free "
            f"or evictable: free (or preempt) running sequences, or make num_blocks larger")


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


class _Sequence:
    __slots__ = ("block_table", "num_tokens", "tail", "last_hash", "extra", "pending",
                 "num_draft")

    def __init__(self, block_table, num_tokens, tail, last_hash, extra):
        self.block_table: list[int] = block_table
        self.num_tokens: int = num_tokens
        self.tail: list[int] = tail          # token ids in the partly filled last block
        self.last_hash: bytes = last_hash    # hash of the last full block (chain parent)
        self.extra: bytes = extra
        self.pending: bool = False           # the last token's id is not known yet
        self.num_draft: int = 0              # trailing tokens awaiting verification


class BlockManager:
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

    def num_draft_tokens(self, seq_id) -> int:
        return self._get(seq_id).num_draft

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
                      s.pending, s.num_draft) for k, s in self._seqs.items())
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
            token_id = _token_id(token_id, "token_id")  # fails here, before anything changes
        pos = seq.num_tokens & self._mask
        copies = []
        try:
            if pos == 0:
                seq.block_table.append(self._take())
            else:
                table = seq.block_table
                last = table[-1]
                if self._ref[last] > 1:  # shared partial block (after fork): copy, then write
                    new = self._take()
                    self._ref[last] -= 1
                    table[-1] = new
                    copies.append((last, new))
        except OutOfBlocks:
            raise OutOfBlocks(f"append_token({seq_id!r})", 1, 0, self.num_blocks) from None
        seq.num_tokens += 1
        if token_id is None:
            seq.pending = True
        if self.enable_prefix_caching:
            seq.tail.append(token_id)
            if pos == self._mask and token_id is not None:
                self._seal(seq, len(seq.block_table) - 1)
        return copies

    def set_token(self, seq_id, token_id: int) -> None:
        """Give the id of a sequence's pending last token (see ``append_token``)."""
        seq = self._get(seq_id)
        if not seq.pending:
            raise ValueError(f"set_token({seq_id!r}): no pending token; append_token(seq_id, None) "
                             "reserves one")
        token_id = _token_id(token_id, "token_id")
        if self.enable_prefix_caching:
            seq.tail[-1] = token_id
            if seq.num_tokens & self._mask == 0:  # the pending token filled its block
                self._seal(seq, len(seq.block_table) - 1)
        seq.pending = False

    def has_pending(self, seq_id) -> bool:
        return self._get(seq_id).pending

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (ref counts go up; nothing is copied)."""
        parent = self._get(parent_id)
        if parent.pending:
            raise ValueError(f"fork: {parent_id!r} has a pending token; set_token first")
        self._check_no_draft(parent_id, parent, "fork")
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

    def can_append_draft(self, seq_id, num_draft: int) -> bool:
        return self._blocks_to_append_draft(self._get(seq_id), num_draft) <= self.num_free_blocks

    def append_draft(self, seq_id, draft_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Give slots to draft tokens that a verify step will write; returns block copies
        ``(src, dst)`` to apply first. No block holding a draft token is sealed: until
        ``accept_draft`` the sequence takes no other token and cannot be forked.

        A verify step of a sequence of n tokens (the last one not yet computed, as for a
        decode) and k drafts writes KV at ``slots(seq_id, n - 1, n + k)``: k + 1 positions."""
        seq = self._get(seq_id)
        if seq.pending:
            raise ValueError(f"append_draft({seq_id!r}): its last token is still pending; a draft "
                             "continues known tokens: call set_token first")
        self._check_no_draft(seq_id, seq, "append_draft")
        if isinstance(draft_token_ids, (str, bytes)) or not hasattr(draft_token_ids, "__len__"):
            raise TypeError(f"append_draft: draft_token_ids must be a list of ints, got "
                            f"{type(draft_token_ids).__name__}")
        drafts = [_token_id(t, f"draft_token_ids[{i}]") for i, t in enumerate(draft_token_ids)]
        need = self._blocks_to_append_draft(seq, len(drafts))
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"append_draft({seq_id!r}, {len(drafts)} tokens)", need,
                              self.num_free_blocks, self.num_blocks)
        copies, table = [], seq.block_table
        if drafts and seq.num_tokens & self._mask and self._ref[table[-1]] > 1:
            new = self._take()  # shared partial block (after fork): copy before writing
            self._ref[table[-1]] -= 1
            copies.append((table[-1], new))
            table[-1] = new
        table.extend(self._take() for _ in range(need - len(copies)))
        seq.num_tokens += len(drafts)
        seq.num_draft = len(drafts)
        if self.enable_prefix_caching:
            seq.tail.extend(drafts)
        return copies

    def accept_draft(self, seq_id, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` draft tokens and roll the rest back: the sequence
        shrinks, blocks past its new end are released, blocks the accepted tokens filled are
        sealed (their KV was written by the verify step). Then append the target's own token."""
        seq = self._get(seq_id)
        if isinstance(num_accepted, bool) or not isinstance(num_accepted, int) or \
                not 0 <= num_accepted <= seq.num_draft:
            raise ValueError(f"accept_draft({seq_id!r}): num_accepted must be an int in "
                             f"[0, {seq.num_draft}] (its draft tokens), got {num_accepted!r}")
        committed = seq.num_tokens - seq.num_draft
        seq.num_tokens = committed + num_accepted
        rejected = seq.num_draft - num_accepted
        seq.num_draft = 0
        keep = -(-seq.num_tokens // self.block_size)
        self._release(seq.block_table[keep:], uncache=False)
        del seq.block_table[keep:]
        if self.enable_prefix_caching:
            del seq.tail[len(seq.tail) - rejected:]
            i = committed // self.block_size  # the tail starts at this block
            while len(seq.tail) >= self.block_size:
                self._seal(seq, i)
                i += 1

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

    def _check_no_draft(self, seq_id, seq: _Sequence, op: str) -> None:
        if seq.num_draft:
            raise ValueError(f"{op}({seq_id!r}): {seq.num_draft} draft token(s) await "
                             "verification; call accept_draft(seq_id, num_accepted) first")

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
        buf = _token_bytes(token_ids)
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

    def _blocks_to_append_draft(self, seq: _Sequence, k: int) -> int:
        if k == 0:
            return 0
        cow = 1 if seq.num_tokens & self._mask and self._ref[seq.block_table[-1]] > 1 else 0
        return -(-(seq.num_tokens + k) // self.block_size) - len(seq.block_table) + cow

    def _blocks_to_append(self, seq: _Sequence) -> int:
        if seq.num_tokens & self._mask == 0:
            return 1
        return 1 if self._ref[seq.block_table[-1]] > 1 else 0
