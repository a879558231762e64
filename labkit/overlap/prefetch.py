"""Copy batch i+1 to the GPU while the GPU computes on batch i.

    for x in Prefetcher(host_batches):      # x: batch i, already on the GPU
        y = model(x)                        # enqueued on the current (compute) stream

Each batch is copied on a copy stream; the compute stream waits on the copy's event (on the
GPU, the CPU does not block) before its first use. The next batch is fetched, and its copy
enqueued, as soon as the loop body has enqueued its work on batch i, so producing it on the CPU
and copying it both run while the GPU computes. ``overlap=False`` does the same copies on the
compute stream, in series: the baseline that shows what the overlap buys.

Lifetimes across streams: a batch's device memory is allocated on the copy stream and marked
with ``record_stream`` for the compute stream, so the allocator cannot hand it to a later copy
while a kernel still reads it. A pinned source batch is copied directly (PyTorch's pinned
allocator does not reuse its memory before the copy is done); a pageable one goes through a
:class:`~labkit.overlap.staging.PinnedStagingPool`, whose event discipline guards the staging buffers.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch

from labkit.device import select_device
from labkit.overlap.staging import InFlightCopy, PinnedStagingPool


@dataclass(frozen=True)
class PrefetchStats:
    batches: int
    copy_ms: float       # time the copies took (GPU time; CPU time on the synchronous path)
    compute_ms: float    # time the work enqueued between two batches took on the compute stream
    wall_ms: float       # first fetch to the end of the last batch's work
    overlap: bool

    @property
    def overlap_efficiency(self) -> float:
        """Share of the shorter of copy and compute hidden behind the other: 1 when the wall
        time is max(copy, compute), 0 when it is their sum; below 0 when other costs (CPU
        work, launch gaps) add to the sum."""
        shorter = min(self.copy_ms, self.compute_ms)
        if shorter <= 0:
            return 0.0
        return (self.copy_ms + self.compute_ms - self.wall_ms) / shorter

    def as_dict(self) -> dict:
        return {**asdict(self), "overlap_efficiency": self.overlap_efficiency}


def _map_leaves(fn, batch, leaf=torch.Tensor, where="batch"):
    if isinstance(batch, leaf):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_leaves(fn, b, leaf, f"{where}[{i}]") for i, b in enumerate(batch))
    if isinstance(batch, dict):
        return {k: _map_leaves(fn, v, leaf, f"{where}[{k!r}]") for k, v in batch.items()}
    raise TypeError(f"{where} is a {type(batch).__name__}; the Prefetcher moves tensors, or "
                    "tuples, lists and dicts of tensors: convert it with torch.as_tensor or "
                    "keep it beside the batch")


_END = object()


class Prefetcher:
    """Iterate ``batches`` (host tensors, or tuples/lists/dicts of them) as device batches.

    ``stats`` is set when the iteration ends (or is abandoned).
    """

    def __init__(self, batches: Iterable, device: str | torch.device = "auto", *,
                 overlap: bool = True, pool: PinnedStagingPool | None = None):
        # Checked here, not at the first next(): the error then points at this line.
        if isinstance(batches, torch.Tensor):  # iterating it would yield its rows as batches
            raise TypeError(f"batches is one tensor {tuple(batches.shape)}; pass an iterable of "
                            "batches: [tensor] for one batch, tensor.split(n) for batches of n "
                            "rows")
        if not hasattr(batches, "__iter__"):
            raise TypeError(f"batches must be an iterable of host batches (a list, a generator), "
                            f"got {type(batches).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        if pool is not None and not isinstance(pool, PinnedStagingPool):
            raise TypeError(f"pool must be a PinnedStagingPool (or None for a new one), got "
                            f"{type(pool).__name__}")
        self.device = select_device(device)
        if pool is not None and (pool.device.type, pool.device.index or 0) != (
                self.device.type, self.device.index or 0):
            raise ValueError(f"the pool copies to {pool.device} but the Prefetcher to "
                             f"{self.device}: give them the same device")
        self.pool = pool or PinnedStagingPool(2, self.device)
        self.overlap = overlap
        self._batches = batches
        self.stats: PrefetchStats | None = None

    def _copy(self, src: torch.Tensor, stream, copy_events: list) -> InFlightCopy:
        if src.device.type == "cuda" and self.device.type == "cuda":   # already there
            return InFlightCopy(src, None, None)
        if self.device.type != "cuda":   # a real copy even here: the batch never aliases its source
            t0 = time.perf_counter()
            copy = self.pool.copy_async(src)
            copy_events.append(time.perf_counter() - t0)
            return copy
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if src.device.type == "cpu" and src.is_pinned() and src.is_contiguous():
            with torch.cuda.stream(stream):
                start.record(stream)
                dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                end.record(stream)
            copy = InFlightCopy(dst, done, stream, source=src)
        else:
            # Fill the staging buffer first, so the copy's events time the DMA, not the CPU.
            self.pool.stage(src.shape, src.dtype).copy_(src)
            start.record(stream)
            copy = self.pool.submit(stream)
            end.record(stream)
        copy_events.append((start, end))
        return copy

    def __iter__(self) -> Iterator:
        on_gpu = self.device.type == "cuda"
        consumer = torch.cuda.current_stream(self.device) if on_gpu else None
        copy_stream = (self.pool.copy_stream if self.overlap else consumer) if on_gpu else None
        copies: list = []
        computes: list = []
        t_start = time.perf_counter()

        def fetch(it):
            host = next(it, _END)
            if host is _END:
                return None
            return _map_leaves(lambda t: self._copy(t, copy_stream, copies), host)

        it = iter(self._batches)
        try:
            staged = fetch(it)
            while staged is not None:
                batch = _map_leaves(lambda c: c.wait(consumer), staged, leaf=InFlightCopy)
                del staged   # the batch's memory now lives as long as the consumer holds it
                if on_gpu:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(consumer)
                else:
                    start = time.perf_counter()
                yield batch
                del batch
                if on_gpu:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(consumer)
                    computes.append((start, end))
                else:
                    computes.append(time.perf_counter() - start)
                staged = fetch(it)
        finally:
            if on_gpu:
                consumer.synchronize()
                copy_stream.synchronize()   # a batch fetched but never consumed is still timed
            wall_ms = (time.perf_counter() - t_start) * 1e3

            def total_ms(spans):
                if on_gpu:
                    return sum(s.elapsed_time(e) for s, e in spans)
                return sum(spans) * 1e3

            self.stats = PrefetchStats(batches=len(computes), copy_ms=total_ms(copies),
                                       compute_ms=total_ms(computes), wall_ms=wall_ms,
                                       overlap=self.overlap)
