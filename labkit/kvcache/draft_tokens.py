"""Draft tokens in the block manager: slots for speculative decoding's guesses, then rollback.

Speculative decoding writes KV for draft tokens that the target model may reject.
``append_draft`` gives them slots (blocks, copy-on-write) but never seals a block holding one:
only ``accept_draft`` commits the accepted ones (sealing the blocks they fill) and rolls the
rest back, releasing blocks past the new end. So the prefix cache never finds a rejected token.

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
    def _check_no_draft(self, seq_id, seq, op: str) -> None:
        if seq.num_draft:
            raise ValueError(f"{op}({seq_id!r}): {seq.num_draft} draft token(s) await "
                             "verification; call accept_draft(seq_id, num_accepted) first")

    def _blocks_to_append_draft(self, seq, k: int) -> int:
        if k == 0:
            return 0
        cow = 1 if seq.num_tokens & self._mask and self._ref[seq.block_table[-1]] > 1 else 0
        return -(-(seq.num_tokens + k) // self.block_size) - len(seq.block_table) + cow
