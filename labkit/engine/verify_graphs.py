"""Full CUDA Graphs of uniform verify steps, keyed by (request bucket, k + 1).

A verify row is a request's last token plus its k draft tokens: a (k + 1)-token query, causal
within the row, over the paged cache. When every row of a step verifies exactly k drafts
(uniform verify), the step's shapes depend on the number of requests alone, as a decode step's
do: ids, positions and slots ``[requests, k + 1]``, one block table and one length per request,
``cu_seqlens_q`` = 0, k + 1, 2(k + 1), ... So the whole forward, attention included, can be
captured per request bucket, like the decode graphs (``cudagraphs.capture_decode_graphs``), with
one more key dimension: the query length k + 1, fixed by the engine's ``SpeculativeConfig``.
Padding rows are the decode graphs' (``cudagraphs.PAD``): their slots are -1, never written, and
their logits are dropped.

Any other step falls back to what it ran before (piecewise graphs or eager) and ``fallbacks``
says why: a prefill chunk or a plain decode in the step, a proposer that came up short of k for
some request, more requests than the largest bucket.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from labkit import check_positive_int
from labkit.engine.cudagraphs import PAD
from labkit.engine.device_metadata import DeviceMetadata
from labkit.engine.request import ScheduledStep
from labkit.graphs import GraphPool

log = logging.getLogger("labkit.engine")


class VerifyGraphs:
    """``verify_forward(ids, positions, slots, block_tables, seq_lens)`` captured per request
    bucket, for rows of ``query_len`` = k + 1 tokens: ids, positions and slots
    ``[requests, query_len]``, block tables ``[requests, max_blocks_per_seq]``, seq_lens
    ``[requests]`` -> logits ``[requests, query_len, vocab]``. Off a GPU the pool cannot
    capture: it checks each call against the captured shapes and runs the function eagerly."""

    def __init__(self, verify_forward: Callable, buckets: Sequence[int], query_len: int,
                 max_blocks_per_seq: int, device: torch.device):
        check_positive_int("query_len", query_len, hint="k + 1: the last token and k drafts")
        if query_len < 2:
            raise ValueError(f"query_len={query_len}: a verify row is the last token plus at "
                             "least one draft (k + 1 >= 2); one token a row is a decode graph")
        self.query_len, self.max_blocks_per_seq, self.device = query_len, max_blocks_per_seq, device
        self.pool = GraphPool(verify_forward, buckets, pad_value=PAD,
                              enabled=device.type == "cuda")
        self.fallbacks: Counter = Counter()  # verify steps that did not replay, by reason

    def keys(self) -> list[tuple[int, int]]:
        """(request bucket, query length) of every graph."""
        return [(key[0], self.query_len) for key in self.pool.keys()]

    @property
    def stats(self):
        """The pool's ``PoolStats``: capture time and memory, replays and padded rows per key."""
        return self.pool.stats

    @torch.inference_mode()
    def capture(self) -> None:
        """Every key from all-padding rows (warm-up and capture write no slot); on a GPU the
        pool's memory is predicted first."""
        q = self.query_len
        row = torch.full((1, q), PAD, dtype=torch.int32, device=self.device)
        table = torch.full((1, self.max_blocks_per_seq), PAD, dtype=torch.int32,
                           device=self.device)
        lens = torch.full((1,), PAD, dtype=torch.int32, device=self.device)
        example = (row, row.clone(), row.clone(), table, lens)
        if self.pool.enabled:
            self.pool.predict_memory(*example)
        self.pool.capture(*example)
        if self.pool.enabled:
            st = self.stats
            log.info(f"captured {len(self.keys())} verify graphs (request buckets "
                     f"{list(self.pool.buckets)} x {q} query tokens) in {st.capture_ms:.0f} ms; "
                     f"{st.captured_bytes / 2**20:.1f} MiB (predicted "
                     f"{st.predicted_bytes / 2**20:.1f})")

    def key_for(self, step: ScheduledStep) -> tuple[int, int] | None:
        """The key a uniform verify step replays, or None (counted in ``fallbacks`` when the
        step verifies drafts at all)."""
        rows = step.rows
        if not any(r.num_draft for r in rows):
            return None  # no verify row: the decode graphs' or piecewise graphs' business
        k = self.query_len - 1
        if any(r.is_prefill for r in rows):
            reason = "a prefill chunk in the step"
        elif any(r.num_draft == 0 for r in rows):
            reason = "a plain decode in the step"
        elif any(r.num_draft != k for r in rows):
            reason = f"a row with other than k={k} drafts"
        elif (key := self.pool.key_for(len(rows))) is None:
            reason = f"more requests than the largest bucket {self.pool.buckets[-1]}"
        else:
            return key[0], self.query_len
        self.fallbacks[reason] += 1
        return None

    def __call__(self, md: DeviceMetadata) -> torch.Tensor:
        """A uniform verify step's logits ``[requests * query_len, vocab]``, in row order (every
        position of a verify row samples). The block tables are padded to the captured width on
        the device: only the used columns crossed the bus."""
        requests, q = md.seq_lens.numel(), self.query_len
        tables = F.pad(md.block_tables, (0, self.max_blocks_per_seq - md.block_tables.shape[1]))
        logits = self.pool(md.input_ids.view(requests, q), md.positions.view(requests, q),
                           md.slot_mapping.view(requests, q), tables, md.seq_lens)
        return logits.flatten(0, 1)
