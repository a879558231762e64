"""Piecewise CUDA graphs: the work between two attentions captured once per token count, with
attention run eagerly in between.

A full graph freezes a whole step: its kernels, their launch grids, their addresses. Uniform
decode can live with that (one query token a row: only the batch size varies), but a step that
mixes prefill chunks and decodes changes attention's launch with every mix: how many query tokens
each row has, where each row starts, how long each context is. Everything else in a layer works
token by token (norms, projections, RoPE, the MLP), so its shapes depend on the token count
alone. Split the forward at attention and capture each piece per token-count bucket; attention
then runs eagerly between the replays, on the step's real tokens and metadata. vLLM's default on
CUDA does this for every step that is not uniform decode (full graphs for those).

``PiecewiseGraphs(pieces, buckets)``: ``pieces[i](n)`` runs piece ``i`` on the first ``n`` rows
of buffers the caller owns (static: allocated once, read and written in place), and
``run(n_real, between)`` replays the pieces of the smallest bucket that holds ``n_real``,
calling ``between(i)`` after piece ``i`` (all but the last). The caller fills the padding rows
so they compute harmlessly (they are never read back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from labkit.graphs.buckets import bucket_for, check_buckets, check_size
from labkit.graphs.pool import capture_graph, segment_bytes

# vLLM's default stops at 512 tokens, where its steps turn compute-bound; labkit's eager ops
# cost the host more per step, so its chunks up to the engine's default budget replay too.
LARGEST_CAPTURE = 2048


def default_token_buckets(max_tokens: int, largest: int = LARGEST_CAPTURE) -> tuple[int, ...]:
    """The token counts piecewise graphs are captured for: 1, 2, 4, then every 8 up to 256,
    every 16 up to 512 (vLLM's default capture sizes), every 64 up to 1024 and every 128 up to
    2048, up to ``min(max_tokens, largest)``, which is always a bucket itself. Padding a step
    of n tokens up to its bucket costs at most 7 tokens below 256, 15 below 512 and under 13%
    above (a 512-token chunk beside 63 decodes replays at 576)."""
    max_tokens = check_size("max_tokens", max_tokens)
    largest = check_size("largest", largest)
    top = min(max_tokens, largest)
    every = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16), *range(576, 1025, 64),
             *range(1152, 2049, 128)]
    return tuple(sorted({b for b in every if b < top} | {top}))


@dataclass
class PieceStats:
    tokens: int                  # the bucket
    capture_ms: float = 0.0
    pool_bytes: int = 0          # growth of the shared graph memory pool during this capture
    replays: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0

    def count(self, num_tokens: int) -> None:
        """One replay of this bucket for a step of ``num_tokens`` real tokens."""
        self.replays += 1
        self.real_tokens += num_tokens
        self.padded_tokens += self.tokens - num_tokens


@dataclass
class PiecewiseStats:
    buckets: dict = field(default_factory=dict)
    num_pieces: int = 0
    predicted_bytes: int | None = None  # predict_memory()'s figure for the pool, before capture

    @property
    def num_graphs(self) -> int:
        return self.num_pieces * len(self.buckets)

    @property
    def capture_ms(self) -> float:
        return sum(b.capture_ms for b in self.buckets.values())

    @property
    def pool_bytes(self) -> int:
        return sum(b.pool_bytes for b in self.buckets.values())

    @property
    def replays(self) -> int:
        return sum(b.replays for b in self.buckets.values())

    @property
    def padded_tokens(self) -> int:
        return sum(b.padded_tokens for b in self.buckets.values())

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"tokens": b.tokens, "graphs": self.num_pieces,
                              "capture_ms": round(b.capture_ms, 2),
                              "pool_MiB": round(b.pool_bytes / 2**20, 2), "replays": b.replays,
                              "real_tokens": b.real_tokens, "padded_tokens": b.padded_tokens}
                             for b in self.buckets.values()])


class PiecewiseGraphs:
    """One graph per (token bucket, piece). ``cuda``: ``torch.cuda`` or labkit's CPU stand-in
    (``labkit.graphs.emulated_cuda``), which freezes what a graph freezes on any machine."""

    def __init__(self, pieces: Sequence[Callable[[int], object]], buckets: Sequence[int], *,
                 cuda=None, warmup: int = 1):
        if not pieces or not all(callable(p) for p in pieces):
            raise TypeError("pieces must be a non-empty list of functions piece(num_tokens)")
        self.pieces = list(pieces)
        self.buckets = tuple(check_buckets("buckets", buckets, "token counts"))
        self.warmup = check_size("warmup", warmup, minimum=0)
        self.cuda = cuda or torch.cuda
        self.stats = PiecewiseStats(num_pieces=len(self.pieces))
        self._graphs: dict[int, list] = {}
        self._mempool = None

    @property
    def on_gpu(self) -> bool:
        return self.cuda is torch.cuda

    def _pool_bytes(self) -> int:
        return segment_bytes(self._mempool) if self.on_gpu else 0

    def predict_memory(self) -> int:
        """Bytes the shared pool should take, before capture: every piece run once eagerly at
        the largest bucket inside a private memory pool, so the allocator rounds as in a graph
        pool. The pieces run one after another and drop their outputs, so what one frees the
        next reuses, in the eager run as in the captured pool, and the smaller buckets fit in
        what the largest took. 0 off a GPU (the stand-in holds no device memory)."""
        if not self.on_gpu:
            self.stats.predicted_bytes = 0
            return 0
        largest = self.buckets[-1]
        for piece in self.pieces:  # warm-up: compiles and lazy workspaces outside the probe
            piece(largest)
        torch.cuda.synchronize()
        probe = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(probe):
            for piece in self.pieces:
                piece(largest)
            torch.cuda.synchronize()
        self.stats.predicted_bytes = segment_bytes(probe.id)
        del probe
        return self.stats.predicted_bytes

    def capture(self) -> PiecewiseStats:
        """Every bucket, largest first, into one memory pool: the pieces run one after another,
        never at once, so a later graph may reuse what an earlier one freed."""
        if self._graphs:
            raise RuntimeError("these piecewise graphs are captured already")
        mempool, side = self.cuda.graph_pool_handle(), self.cuda.Stream()
        self._mempool = mempool
        captured, stats = {}, {}
        try:
            for tokens in sorted(self.buckets, reverse=True):
                self.cuda.synchronize()
                pool0, t0 = self._pool_bytes(), time.perf_counter()
                graphs = []
                for piece in self.pieces:
                    # a piece writes its results into the caller's buffers: outputs are dropped
                    graph, _ = capture_graph(lambda piece=piece: piece(tokens), self.warmup,
                                             pool=mempool, side=side, cuda=self.cuda)
                    graphs.append(graph)
                self.cuda.synchronize()
                captured[tokens] = graphs
                stats[tokens] = PieceStats(tokens, (time.perf_counter() - t0) * 1e3,
                                           self._pool_bytes() - pool0)
        except BaseException:
            self._mempool = None  # nothing captured: the graphs made so far are dropped
            raise
        self._graphs = dict(sorted(captured.items()))
        self.stats.buckets = dict(sorted(stats.items()))
        return self.stats

    def bucket_for(self, num_tokens: int) -> int | None:
        """The captured token count a step of ``num_tokens`` replays at; None: larger than every
        bucket (the step runs eagerly)."""
        num_tokens = check_size("num_tokens", num_tokens)
        return bucket_for(num_tokens, self.buckets, default=None)

    def run(self, num_tokens: int, between: Callable[[int], object]) -> int:
        """Replays piece 0, ``between(0)``, piece 1, ..., the last piece at the bucket of
        ``num_tokens``; returns that bucket. The caller has filled rows ``num_tokens:bucket``."""
        if not self._graphs:
            raise RuntimeError("capture() the piecewise graphs before running them")
        bucket = self.bucket_for(num_tokens)
        if bucket is None:
            raise ValueError(f"num_tokens={num_tokens} is larger than the largest captured "
                             f"bucket {self.buckets[-1]}: run that step eagerly")
        graphs = self._graphs[bucket]
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(graphs) - 1:
                between(i)
        self.stats.buckets[bucket].count(num_tokens)
        return bucket
