"""The measurements behind notebook 02 and benchmarks/graphs.py: a decode step eager against
replayed from a GraphPool, the pool's own overhead against a bare CUDAGraph, and what each
bucket costs in capture time and memory.
"""
from __future__ import annotations

import time

import pandas as pd
import torch

from labkit.measure import bench
from labkit.lessons.cuda_graphs.decode_stack import DecodeStack
from labkit.device import select_device
from labkit.graphs import GraphPool, capture_graph

FULL = dict(n_layers=8, width=2048, n_heads=16, context=256)
SMALL = dict(n_layers=2, width=256, n_heads=4, context=32)


def make_stack(device, quick: bool = False, max_batch: int = 256) -> DecodeStack:
    dev = select_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return DecodeStack(**(SMALL if quick else FULL), max_batch=max_batch, dtype=dtype, device=dev)


def _hidden(stack: DecodeStack, batch: int) -> torch.Tensor:
    p = next(stack.parameters())
    return torch.randn(batch, stack.layers[0].norm1.numel(), device=p.device, dtype=p.dtype)


def step_times(stack: DecodeStack, batches, pool: GraphPool | None = None,
               repeats: int = 20) -> pd.DataFrame:
    """Per batch size: one decode step eager, and replayed from ``pool`` (when there is a GPU)."""
    rows = []
    for b in batches:
        x = _hidden(stack, b)
        eager = bench.measure(lambda: stack(x), device=x.device, repeats=repeats)
        row = {"batch": b, "eager_us": eager.median_us}
        if pool is not None and pool.enabled:
            replay = bench.measure(lambda: pool(x), device=x.device, repeats=repeats)
            row.update(graph_us=replay.median_us, speedup=eager.median_us / replay.median_us,
                       bucket=pool.key_for(b)[0])
        rows.append(row)
    return pd.DataFrame(rows)


def pool_overhead(stack: DecodeStack, batch: int = 8, repeats: int = 50) -> dict:
    """The pool's call (copy in, pick the bucket, replay, slice) against a bare CUDAGraph replay
    of the same bucket, measured back to back in one run."""
    x = _hidden(stack, batch)
    static = x.clone()
    bare, _ = capture_graph(lambda: stack(static))
    views = GraphPool(stack, buckets=(batch,), copy_outputs=False)
    owned = GraphPool(stack, buckets=(batch,))
    views.capture(x)
    owned.capture(x)
    t_bare = bench.measure(bare.replay, device=x.device, repeats=repeats)
    t_copy_bare = bench.measure(lambda: (static.copy_(x), bare.replay()), device=x.device,
                                repeats=repeats)
    t_views = bench.measure(lambda: views(x), device=x.device, repeats=repeats)
    t_owned = bench.measure(lambda: owned(x), device=x.device, repeats=repeats)
    return {"batch": batch, "bare_replay_us": t_bare.median_us,
            "bare_copy_and_replay_us": t_copy_bare.median_us, "pool_views_us": t_views.median_us,
            "pool_owned_us": t_owned.median_us,
            "overhead_vs_bare": t_views.median_us / t_bare.median_us - 1,
            "overhead_vs_copy_and_replay": t_views.median_us / t_copy_bare.median_us - 1,
            "clone_cost_us": t_owned.median_us - t_views.median_us}


def capture_costs(stack: DecodeStack, buckets=(1, 2, 4, 8, 16, 32, 64, 96, 128, 256),
                  context_buckets=None) -> dict:
    """Capture every bucket of a fresh pool: time and memory per key, against the prediction."""
    fn = stack if context_buckets is None else (lambda x, context_bucket: stack(x))
    pool = GraphPool(fn, buckets=buckets, context_buckets=context_buckets)
    x = _hidden(stack, 1)
    predicted = pool.predict_memory(x)
    t0 = time.perf_counter()
    pool.capture(x)
    total_s = time.perf_counter() - t0
    return {"keys": len(pool.stats.buckets), "capture_s": total_s,
            "predicted_MiB": predicted / 2**20, "captured_MiB": pool.stats.captured_bytes / 2**20,
            "static_input_MiB": pool.stats.static_input_bytes / 2**20,
            "per_key": pool.stats.table().assign(key=lambda d: d.key.astype(str)).to_dict(orient="list")}


def record() -> dict:
    stack = make_stack("cuda")
    pool = GraphPool(stack, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    times = step_times(stack, [1, 2, 3, 4, 8, 12, 16, 32, 64, 100, 128, 256], pool)
    from labkit.measure.profile import trace

    x = _hidden(stack, 8)
    return {"model": FULL, "step_times": times.to_dict(orient="list"),
            "trace_eager": trace(lambda: stack(x), device=x.device).to_dict(),
            "trace_graph": trace(lambda: pool(x), device=x.device).to_dict(),
            "overhead": pool_overhead(stack), "capture": capture_costs(stack),
            "capture_with_context": capture_costs(stack, (1, 8, 64, 256), (1024, 8192)),
            "capture_batch_only": capture_costs(stack, (1, 8, 64, 256))}
