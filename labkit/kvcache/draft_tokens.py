"""Draft tokens in the block manager: slots for speculative decoding's guesses, then rollback.

Speculative decoding writes KV for draft tokens that the target model may reject.
``append_draft`` gives them slots (blocks, copy-on-write) but never seals a block holding one:
only ``accept_draft`` commits the accepted ones (sealing the blocks they fill) and rolls the
rest back, releasing blocks past the new end. So the prefix cache never finds a rejected token.

With async scheduling the next step is planned before this one's accepted count is known, so
its row's positions are not known either: ``reserve`` holds blocks for the longest outcome
(every draft accepted) without adding tokens, ``accept_draft`` keeps them, the tokens placed
once the count is known take them, and ``release_reserve`` gives back what the outcome left
unused. The next step's KV goes into blocks that were in its block table when it was launched.

:class:`DraftTokens` holds these operations; ``BlockManager`` inherits them, so they read and
change its own block tables, ref counts and prefix cache (a ``seq`` argument is its record of
one sequence). Like every operation of the manager, each checks before it changes anything.
"""
from __future__ import annotations

from typing import Sequence

from labkit.kvcache.refusals import OutOfBlocks, check_token_id


class DraftTokens:
    """The block manager's draft-token operations (see the module docstring)."""

    def num_draft_tokens(self, seq_id) -> int:
        return self._get(seq_id).num_draft

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
        drafts = [check_token_id(t, f"draft_token_ids[{i}]") for i, t in enumerate(draft_token_ids)]
        need = self._blocks_to_append_draft(seq, len(drafts))
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"append_draft({seq_id!r}, {len(drafts)} tokens)", need,
                              self.num_free_blocks, self.num_blocks)
        copies, table = [], seq.block_table
        i = seq.num_tokens // self.block_size
        if drafts and seq.num_tokens & self._mask and self._ref[table[i]] > 1:
            new = self._take()  # shared partial block (after fork): copy before writing
            self._ref[table[i]] -= 1
            copies.append((table[i], new))
            table[i] = new
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
        keep = -(-max(seq.num_tokens, seq.capacity) // self.block_size)  # reserved ones stay
        self._release(seq.block_table[keep:], uncache=False)
        del seq.block_table[keep:]
        if self.enable_prefix_caching:
            del seq.tail[len(seq.tail) - rejected:]
            i = committed // self.block_size  # the tail starts at this block
            while len(seq.tail) >= self.block_size:
                self._seal(seq, i)
                i += 1

    def can_reserve(self, seq_id, capacity: int) -> bool:
        return self._blocks_to_reserve(self._get(seq_id), capacity) <= self.num_free_blocks

    def reserve(self, seq_id, capacity: int) -> None:
        """Hold blocks for ``capacity`` tokens of the sequence, tokens it does not have yet
        (async speculation: the next step's row lands where the accepted count puts it, up to
        that many tokens). Appends take these blocks in order; ``accept_draft`` keeps them;
        ``release_reserve`` gives back those still empty. A shared partial last block (after
        ``fork``) is refused: it would need a copy first."""
        seq = self._get(seq_id)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or \
                capacity < seq.num_tokens:
            raise ValueError(f"reserve({seq_id!r}): capacity must be an int >= its "
                             f"{seq.num_tokens} tokens, got {capacity!r}")
        if seq.num_tokens & self._mask and \
                self._ref[seq.block_table[seq.num_tokens // self.block_size]] > 1:
            raise ValueError(f"reserve({seq_id!r}): its partial last block is shared (fork); "
                             "append to it first")
        need = self._blocks_to_reserve(seq, capacity)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"reserve({seq_id!r}, {capacity} tokens)", need,
                              self.num_free_blocks, self.num_blocks)
        seq.block_table.extend(self._take() for _ in range(need))
        seq.capacity = max(seq.capacity, capacity)

    def release_reserve(self, seq_id) -> None:
        """Stop holding blocks ahead: those past the sequence's tokens go back (they hold no
        KV the cache could find)."""
        seq = self._get(seq_id)
        seq.capacity = 0
        keep = -(-seq.num_tokens // self.block_size)
        self._release(seq.block_table[keep:], uncache=False)
        del seq.block_table[keep:]

    # ------------------------------------------------------------------ internals
    def _check_no_draft(self, seq_id, seq, op: str) -> None:
        if seq.num_draft:
            raise ValueError(f"{op}({seq_id!r}): {seq.num_draft} draft token(s) await "
                             "verification; call accept_draft(seq_id, num_accepted) first")

    def _blocks_to_append_draft(self, seq, k: int) -> int:
        if k == 0:
            return 0
        i = seq.num_tokens // self.block_size
        cow = 1 if seq.num_tokens & self._mask and self._ref[seq.block_table[i]] > 1 else 0
        return max(0, -(-(seq.num_tokens + k) // self.block_size) - len(seq.block_table)) + cow

    def _blocks_to_reserve(self, seq, capacity: int) -> int:
        return max(0, -(-capacity // self.block_size) - len(seq.block_table))
