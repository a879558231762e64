"""A step's metadata on the device: one int32 buffer, one host-to-device copy.

The runner builds a step's metadata on the host (``step_metadata.build_step_metadata``: token
ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables, logits_indices) and
:func:`metadata_to_device` packs it into ONE int32 host buffer, pinned on a GPU, and copies it to
the device in one transfer on a copy stream (the compute stream waits on its event; with async
scheduling the copy runs while the previous step still computes, and input tokens still PENDING
on the host are gathered from that step's samples on the device). :class:`DeviceMetadata` holds
the int32 views of that buffer; :func:`decode_inputs` is what a full decode graph reads of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from labkit.engine.step_metadata import StepMetadata
from labkit.kernels.rows_ahead import move_rows
from labkit.overlap.staging import PinnedStagingPool


@dataclass(frozen=True)
class DeviceMetadata:
    """A step's metadata on the device: int32 views of one transferred buffer."""
    input_ids: torch.Tensor       # [num_tokens]
    positions: torch.Tensor       # [num_tokens]
    slot_mapping: torch.Tensor    # [num_tokens]
    cu_seqlens_q: torch.Tensor    # [num_rows + 1]
    seq_lens: torch.Tensor        # [num_rows]
    block_tables: torch.Tensor    # [num_rows, max_blocks]
    logits_indices: torch.Tensor  # [num_sampled]
    sample_starts: torch.Tensor | None = None  # [rows that sample + 1]: their first samples


def decode_inputs(md: DeviceMetadata) -> tuple[torch.Tensor, ...]:
    """What a decode graph reads, each with the batch in dim 0 (cu_seqlens_q and
    logits_indices of a decode batch are both 0..B, so the graph makes them itself)."""
    return md.input_ids, md.positions, md.slot_mapping, md.block_tables, md.seq_lens


def metadata_to_device(md: StepMetadata, staging: PinnedStagingPool | None,
                       prev_tokens: torch.Tensor | None = None,
                       prev_accepted: torch.Tensor | None = None,
                       block_size: int | None = None) -> DeviceMetadata:
    """One int32 buffer, one host-to-device copy on the copy stream; the compute stream
    waits on its event (the host does not). Input tokens still PENDING on the host are
    taken from ``prev_tokens``, the previous step's samples on the device (one per row that
    samples). Rows planned ahead of the previous step's accepted counts (async speculation)
    are moved by ``prev_accepted`` (``labkit.kernels.rows_ahead.move_rows``, in place; its
    ``block_size`` gives their slots).
    ``staging``: the runner's pinned buffers (None on CPU: the buffer is used where it is)."""
    width = md.block_tables.shape[1]
    parts = (md.input_ids, md.positions, md.slot_mapping, md.cu_seqlens_q, md.seq_lens,
             md.block_tables, md.logits_indices, md.pending_dst, md.pending_src, md.shift_dst,
             md.shift_src, md.shift_off, md.shift_row, md.shift_win, md.window, md.sample_starts)
    sizes = [len(p) for p in parts]
    sizes[5] = md.block_tables.size
    # numpy converts a list of ints in C: a mixed step's padded block tables alone are
    # tens of thousands of them, which torch.tensor(list) takes a millisecond for.
    flat = torch.from_numpy(np.concatenate(
        [np.asarray(p, dtype=np.int32).reshape(-1) for p in parts]))
    if staging is None:
        buf = flat
    else:
        host = staging.stage(flat.shape, torch.int32)
        host.copy_(flat)
        buf = staging.submit().wait()
    ids, pos, slots, cu, lens, tables, logits_idx, dst, src, *ahead, sample_starts = \
        buf.split(sizes)
    tables = tables.view(len(md.seq_lens), width)
    if len(md.pending_dst) or len(md.shift_dst):
        if prev_tokens is None:
            raise RuntimeError("this step reads tokens sampled by the previous one: pass "
                               "that step's device tokens (async scheduling)")
    if len(md.pending_dst):
        ids = ids.index_put((dst.long(),), prev_tokens[src.long()].to(ids.dtype))
    if len(md.shift_dst):
        if prev_accepted is None or block_size is None:
            raise RuntimeError("rows planned ahead of the previous step's accepted counts: "
                               "pass them (prev_accepted) and the block size")
        move_rows(ids, pos, slots, lens, tables, *ahead, prev_tokens, prev_accepted, block_size)
    return DeviceMetadata(ids, pos, slots, cu, lens, tables, logits_idx, sample_starts)

