"""A pool of CUDA Graphs, one per batch-size bucket, as inference engines use for decode.

A graph replays exactly what was captured: the same kernels reading and writing the same
addresses with the same sizes. So the pool keeps one static input buffer per input (every
bucket reads a slice of it), copies each call's inputs *into* it (``copy_``; rebinding a name
would leave the graph reading the old buffer), pads the batch up to the smallest captured
bucket, replays, and hands back the real rows, cloned, because the next replay overwrites the
graph's outputs in place. Batches larger than the largest bucket run eagerly, and are counted.

Keys may carry a second dimension, a context-length bucket, for code that picks its kernel by
context length: the choice is frozen into each graph, so each choice needs its own graph.
"""
from __future__ import annotations

import gc
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from labkit.graphs.buckets import bucket_for, check_buckets, check_size

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class BucketStats:
    key: tuple
    capture_ms: float = 0.0
    pool_bytes: int = 0          # growth of the shared graph memory pool during this capture
    replays: int = 0
    rows: int = 0                # real rows served
    padded_rows: int = 0


@dataclass
class PoolStats:
    buckets: dict = field(default_factory=dict)
    static_input_bytes: int = 0
    predicted_bytes: int | None = None
    eager_calls: int = 0
    eager_reasons: Counter = field(default_factory=Counter)

    @property
    def captured_bytes(self) -> int:
        return self.static_input_bytes + sum(b.pool_bytes for b in self.buckets.values())

    @property
    def replays(self) -> int:
        return sum(b.replays for b in self.buckets.values())

    @property
    def padded_rows(self) -> int:
        return sum(b.padded_rows for b in self.buckets.values())

    @property
    def capture_ms(self) -> float:
        return sum(b.capture_ms for b in self.buckets.values())

    def table(self) -> pd.DataFrame:
        rows = [{"key": b.key, "capture_ms": round(b.capture_ms, 2),
                 "pool_MiB": round(b.pool_bytes / 2**20, 2), "replays": b.replays,
                 "rows": b.rows, "padded_rows": b.padded_rows} for b in self.buckets.values()]
        return pd.DataFrame(rows)


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def segment_bytes(mempool) -> int:
    """Bytes of device memory in the segments of the graph memory pool ``mempool`` (a
    ``graph_pool_handle()``; None: none)."""
    if mempool is None:
        return 0
    pool_id = tuple(mempool)
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == pool_id)


def capture_graph(fn: Callable, warmup: int = 2, pool=None, side=None, cuda=None):
    """Warm ``fn()`` up on a side stream, then capture it: returns (graph, fn's outputs).

    Warm-up first, so lazy initialisation, autotuning and first allocations (which may
    synchronise with the host, illegal during capture) happen outside the graph. ``cuda``:
    ``torch.cuda`` (the default) or labkit's CPU stand-in (``labkit.graphs.emulated_cuda``).
    """
    cuda = cuda or torch.cuda
    side = side or cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for _ in range(warmup):
            fn()
    cuda.current_stream().wait_stream(side)
    graph = cuda.CUDAGraph()
    # The cyclic collector is held off while capturing: freeing an unreachable old graph then
    # destroys it, which CUDA forbids during a capture (it invalidates this one), and torch no
    # longer collects before capture unless torch.compiler.config.force_cudagraph_gc is set.
    collecting = gc.isenabled()
    gc.disable()
    try:
        # Capture on the warm-up stream: per-stream state made during warm-up (cuBLAS keeps a
        # workspace per stream, 32 MiB on Hopper) is then reused instead of landing in the graph.
        with cuda.graph(graph, pool=pool, stream=side):
            outputs = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs


class GraphPool:
    """``pool = GraphPool(fn, buckets)``; ``out = pool(*inputs)``.

    ``fn(*inputs)`` takes tensors whose dim 0 is the batch and returns a tensor or a tuple of
    tensors with the batch in dim 0; rows must not depend on each other (padding rows are
    computed and dropped). With ``context_buckets``, call ``pool(*inputs, context=n)`` and
    ``fn`` receives ``context_bucket=`` the bucket's value at capture.
    ``copy_outputs=False`` returns views of the graph's output buffers instead of clones:
    faster, but the next replay overwrites them.
    """

    def __init__(self, fn: Callable, buckets: Sequence[int] = DEFAULT_BUCKETS, *,
                 context_buckets: Sequence[int] | None = None, copy_outputs: bool = True,
                 warmup: int = 2, pad_value: float = 0.0, enabled: bool = True):
        if not callable(fn):
            raise TypeError(f"fn must be the function to capture, got {type(fn).__name__}")
        buckets = check_buckets("buckets", buckets)
        if context_buckets is not None:
            context_buckets = check_buckets("context_buckets", context_buckets,
                                            "context lengths")
        warmup = check_size("warmup", warmup, minimum=0)
        if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)):
            raise TypeError(f"pad_value must be a number (what padding rows are filled with), "
                            f"got {pad_value!r}")
        self.fn, self.buckets, self.context_buckets = fn, buckets, context_buckets
        self.copy_outputs, self.warmup, self.pad_value = copy_outputs, warmup, pad_value
        self.enabled = enabled and torch.cuda.is_available()
        self.stats = PoolStats()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._static: tuple[torch.Tensor, ...] = ()
        self._spec: list[tuple] | None = None
        self._mempool = None
        self._side = None
        if enabled and not torch.cuda.is_available():
            warnings.warn("GraphPool: no CUDA device, so every call runs eagerly (same results, "
                          "no graphs); the stats count these calls", stacklevel=2)

    # -- capture -------------------------------------------------------------------------
    def keys(self) -> list[tuple]:
        ctx = self.context_buckets or [None]
        return [(b, c) if c is not None else (b,) for b in self.buckets for c in ctx]

    def _call_fn(self, args, context_bucket):
        if self.context_buckets is None:
            return self.fn(*args)
        return self.fn(*args, context_bucket=context_bucket)

    def capture(self, *example_inputs: torch.Tensor) -> PoolStats:
        """Capture every key, largest first, sharing one memory pool. Inputs give the spec.
        A pool that cannot capture (no CUDA device) still keeps the spec and checks every call
        against it, so an input a graph would refuse is refused on a laptop too."""
        if self._graphs:
            raise RuntimeError("this pool is already captured; make a new GraphPool to re-capture")
        self._spec = [(tuple(x.shape[1:]), x.dtype, x.device) for x in example_inputs]
        if not self.enabled:
            return self.stats
        if any(x.device.type != "cuda" for x in example_inputs):
            raise ValueError("GraphPool inputs must be CUDA tensors; got devices "
                             f"{[str(x.device) for x in example_inputs]}")
        largest = self.buckets[-1]
        # One static buffer per input, sized for the largest bucket; every graph reads a slice.
        self._static = tuple(
            x[torch.arange(largest, device=x.device) % max(len(x), 1)].contiguous()
            if len(x) else torch.zeros((largest, *x.shape[1:]), dtype=x.dtype, device=x.device)
            for x in example_inputs)
        self.stats.static_input_bytes = sum(s.numel() * s.element_size() for s in self._static)
        self._mempool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up: the allocator caches blocks per stream, so a new
        # stream per capture would strand a fresh set of warm-up blocks each time.
        self._side = torch.cuda.Stream()
        for key in sorted(self.keys(), reverse=True):
            self._capture_one(key)
        return self.stats

    def graph(self, key: tuple) -> torch.cuda.CUDAGraph:
        """The captured graph of ``key`` (as ``keys()`` names it): to replay it alone, as a
        benchmark does, once a call has put real inputs in its static buffers."""
        if key not in self._graphs:
            raise KeyError(f"no graph captured for key {key}; captured: {sorted(self._graphs)}")
        return self._graphs[key][0]

    def pool_bytes(self) -> int:
        """Bytes of device memory held by this pool's graphs (segments of its private pool)."""
        return segment_bytes(self._mempool)

    def _capture_one(self, key: tuple) -> None:
        batch, ctx = key[0], (key[1] if len(key) > 1 else None)
        args = tuple(s[:batch] for s in self._static)
        torch.cuda.synchronize()
        pool0, t0 = self.pool_bytes(), time.perf_counter()
        graph, outs = capture_graph(lambda: self._call_fn(args, ctx), self.warmup,
                                    pool=self._mempool, side=self._side)
        torch.cuda.synchronize()
        self._graphs[key] = (graph, _as_tuple(outs))
        capture_ms = (time.perf_counter() - t0) * 1e3
        self.stats.buckets[key] = BucketStats(key=key, capture_ms=capture_ms,
                                              pool_bytes=self.pool_bytes() - pool0)

    # -- replay --------------------------------------------------------------------------
    def _check(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self._spec):
            raise ValueError(f"GraphPool captured {len(self._spec)} inputs, got {len(inputs)}")
        for i, (x, (trailing, dtype, device)) in enumerate(zip(inputs, self._spec)):
            if tuple(x.shape[1:]) != trailing or x.dtype != dtype or x.device != device:
                raise ValueError(
                    f"input {i} is {tuple(x.shape)} {x.dtype} on {x.device}; the graphs were "
                    f"captured for (batch, *{trailing}) {dtype} on {device}. A graph replays "
                    "fixed shapes, dtypes and addresses: make a pool for this input")
        batches = {len(x) for x in inputs}
        if len(batches) != 1:
            raise ValueError(f"all inputs must share dim 0 (the batch), got {sorted(batches)}")

    def _eager(self, inputs, context, reason: str):
        self.stats.eager_calls += 1
        self.stats.eager_reasons[reason] += 1
        if self.context_buckets is None:
            return self.fn(*inputs)
        return self.fn(*inputs, context_bucket=context)

    def key_for(self, batch: int, context: int | None = None) -> tuple | None:
        """The smallest captured key that holds this batch (and context), or None."""
        batch = check_size("batch", batch, minimum=0)
        if (context is None) != (self.context_buckets is None):
            raise ValueError("pass context= exactly when the pool has context_buckets")
        if context is not None:
            context = check_size("context", context, minimum=0)
        bucket = bucket_for(batch, self.buckets, default=None)
        if bucket is None or self.context_buckets is None:
            return None if bucket is None else (bucket,)
        ctx = bucket_for(context, self.context_buckets, default=None)
        return None if ctx is None else (bucket, ctx)

    def __call__(self, *inputs: torch.Tensor, context: int | None = None):
        if (context is None) != (self.context_buckets is None):
            raise ValueError("pass context= exactly when the pool has context_buckets")
        if not self.enabled:
            if self._spec is not None:
                self._check(inputs)
            return self._eager(inputs, context, "no CUDA device")
        if not self._graphs:
            self.capture(*inputs)
        self._check(inputs)
        batch = len(inputs[0])
        key = self.key_for(batch, context)
        if key is None:
            limit = (f"batch {batch} > largest bucket {self.buckets[-1]}"
                     if batch > self.buckets[-1] else
                     f"context {context} > largest context bucket {self.context_buckets[-1]}")
            return self._eager(inputs, context, limit)
        graph, outs = self._graphs[key]
        for static, x in zip(self._static, inputs):
            static[:batch].copy_(x)  # into the captured addresses: never rebind
            if batch < key[0]:
                static[batch:key[0]].fill_(self.pad_value)
        graph.replay()
        st = self.stats.buckets[key]
        st.replays, st.rows, st.padded_rows = st.replays + 1, st.rows + batch, st.padded_rows + key[0] - batch
        real = tuple(o[:batch].clone() if self.copy_outputs else o[:batch] for o in outs)
        return real if len(real) > 1 else real[0]

    # -- memory ----------------------------------------------------------------------------
    def predict_memory(self, *example_inputs: torch.Tensor) -> int:
        """Bytes the captured pool should take, from one eager run at the largest key.

        Graphs captured largest first into one shared pool reuse its blocks, so the pool needs
        about the segments the largest bucket's eager call takes (measured by running it once
        inside a private memory pool, so the allocator's rounding is the same), plus the static
        input buffers, plus the outputs of every other key, which each graph keeps for its
        replays (rows in proportion to its batch bucket).
        """
        if not self.enabled:
            return 0
        largest = self.buckets[-1]
        args = tuple(x[torch.arange(largest, device=x.device) % max(len(x), 1)]
                     for x in example_inputs)
        ctx = self.context_buckets[-1] if self.context_buckets else None
        self._call_fn(args, ctx)  # warm-up outside the measurement
        torch.cuda.synchronize()
        static = sum(a.numel() * a.element_size() for a in args)
        if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
            # the same allocator rounding a graph pool sees: run once inside a private pool
            probe = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(probe):
                out = self._call_fn(args, ctx)
                torch.cuda.synchronize()
            out_bytes = sum(o.numel() * o.element_size() for o in _as_tuple(out))
            del out
            pool_id = tuple(probe.id)
            workspace = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                            if tuple(seg.get("segment_pool_id", ())) == pool_id)
            del probe
        else:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = self._call_fn(args, ctx)
            torch.cuda.synchronize()
            out_bytes = sum(o.numel() * o.element_size() for o in _as_tuple(out))
            del out
            segment = 2 * 2**20
            workspace = -(-(torch.cuda.max_memory_allocated() - base) // segment) * segment
        # the other keys' outputs stay allocated: their rows scale with the batch bucket
        others = sum(key[0] for key in self.keys()) - largest
        self.stats.predicted_bytes = workspace + static + out_bytes * others // largest
        return self.stats.predicted_bytes
