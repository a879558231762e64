"""The arrays a runner needs for one scheduled step, built from the step and the block tables.

Tokens of all rows are packed one after another (varlen, no padding between rows):
``cu_seqlens_q`` marks where each row's new tokens start; ``seq_lens`` is how many keys each row
attends to (its cached context plus its new tokens); ``slot_mapping`` says where each new token's
K and V are stored; ``block_tables`` lets attention read a row's whole context from the cache.
Build it after ``schedule()`` and before ``update()``: a request that finishes in ``update``
gives its blocks back. ``ModelRunner.to_device`` takes it to the device: one int32 buffer, one
copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.engine.request import ScheduledStep
from labkit.kvcache.block_manager import BlockManager


@dataclass(frozen=True)
class StepMetadata:
    input_ids: list[int]            # [num_tokens]
    positions: list[int]            # [num_tokens]
    slot_mapping: list[int]         # [num_tokens]
    cu_seqlens_q: list[int]         # [num_rows + 1]
    seq_lens: list[int]             # [num_rows]
    block_tables: np.ndarray        # int32 [num_rows, max_blocks], padded with pad_block
    logits_indices: list[int]       # [num_sampled] token index whose logits are sampled
    max_seqlen_q: int
    max_seqlen_k: int
    # Async scheduling: input_ids[pending_dst[i]] is PENDING on the host; the runner takes it
    # from the previous step's device samples, row pending_src[i].
    pending_dst: list[int] = ()
    pending_src: list[int] = ()
    # Async speculation: rows planned before the step in flight's accepted counts are known
    # (``ScheduledSeq.draft_window``). For each of their tokens: where it is, which sample row
    # of that step shifts it, its offset in the row, its row, and (offset >= 1) its draft's
    # index in ``window`` for A = 0. The host values of these tokens and their rows are for
    # A = 0; ``metadata_to_device`` moves them (``labkit.kernels.rows_ahead``).
    shift_dst: list[int] = ()
    shift_src: list[int] = ()
    shift_off: list[int] = ()
    shift_row: list[int] = ()
    shift_win: list[int] = ()
    window: list[int] = ()
    sample_starts: list[int] = (0,)  # [rows that sample + 1]: where each one's samples start

    @property
    def lengths_known(self) -> bool:
        """False when a row's length waits on the step in flight (async speculation): the
        host lengths are then lower bounds, and only the device's are exact."""
        return not self.shift_dst

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_metadata(step: ScheduledStep, bm: BlockManager, *,
                        max_blocks_per_seq: int | None = None, pad_block: int = 0
                        ) -> StepMetadata:
    """Metadata of ``step`` in row order. ``max_blocks_per_seq`` fixes the block table width
    (static buffers for graphs); by default it is the longest row's table."""
    input_ids, positions, slot_mapping = [], [], []
    cu_seqlens_q, seq_lens, tables, logits_indices = [0], [], [], []
    pending_dst, pending_src = [], []
    shift = {"dst": [], "src": [], "off": [], "row": [], "win": []}
    window, sample_starts, longest = [], [0], 0
    for i, row in enumerate(step.rows):
        rid, end = row.request_id, row.start + row.num_tokens
        base = len(input_ids)
        if row.draft_window is not None:  # planned ahead: as if A = 0 here, moved on the device
            reach = end + len(row.draft_window) - row.num_draft  # its end if every draft is kept
            if len(bm.block_table(rid)) * bm.block_size < reach:
                raise ValueError(f"request {rid!r} holds blocks for "
                                 f"{len(bm.block_table(rid)) * bm.block_size} tokens, its row "
                                 f"may reach {reach}: reserve them when it is scheduled")
            shift["dst"] += range(base, base + row.num_tokens)
            shift["src"] += [row.input_from] * row.num_tokens
            shift["off"] += range(row.num_tokens)
            shift["row"] += [i] * row.num_tokens
            shift["win"] += [0, *range(len(window), len(window) + row.num_draft)]
            window += row.draft_window
            slot_mapping += [0] * row.num_tokens  # the device computes them
            longest = max(longest, reach)
        else:
            if bm.num_tokens(rid) != end:
                raise ValueError(f"request {rid!r} holds slots for {bm.num_tokens(rid)} tokens, "
                                 f"the step computes up to position {end}: build metadata right "
                                 "after schedule(), before update()")
            if row.input_from is not None:  # the last token is still on the device
                pending_dst.append(base + row.num_tokens - 1)
                pending_src.append(row.input_from)
            slot_mapping += bm.slots(rid, row.start, end)
            longest = max(longest, end)
        input_ids += row.token_ids
        positions += row.positions
        cu_seqlens_q.append(cu_seqlens_q[-1] + row.num_tokens)
        seq_lens.append(end)
        tables.append(bm.block_table(rid))
        last = cu_seqlens_q[-1] - 1
        logits_indices += range(last - row.num_logits + 1, last + 1)
        if row.num_logits:
            sample_starts.append(sample_starts[-1] + row.num_logits)
    width = max((len(t) for t in tables), default=0)
    if max_blocks_per_seq is not None:
        if width > max_blocks_per_seq:
            raise ValueError(f"a row holds {width} blocks, more than max_blocks_per_seq="
                             f"{max_blocks_per_seq}; size it for max_model_len / block_size")
        width = max_blocks_per_seq
    # An array filled row by row: a long prompt's table sets the width of every row, and
    # padding Python lists to it (then converting them) cost milliseconds a mixed step.
    padded = np.full((len(tables), width), pad_block, dtype=np.int32)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    tables = padded
    if shift["dst"]:
        window.append(0)  # what offset-0 tokens index (they take the sampled token instead)
        shift["win"] = [len(window) - 1 if off == 0 else w
                        for off, w in zip(shift["off"], shift["win"])]
    return StepMetadata(input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, tables,
                        logits_indices, max((r.num_tokens for r in step.rows), default=0),
                        longest, pending_dst, pending_src, shift["dst"], shift["src"],
                        shift["off"], shift["row"], shift["win"], window, sample_starts)
