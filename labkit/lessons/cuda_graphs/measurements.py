"""The measurements behind notebook 02 and benchmarks/graphs.py: a decode step eager against
replayed from a GraphPool (in interleaved rounds, with the GPU's busy time beside the wall
time), what padding a batch up to its bucket costs against a graph of the exact size, the
pool's own overhead against a bare CUDAGraph, and what each bucket costs to capture and hold.

Every result is plain lists (JSON, so `make record` can keep it): per case the per-round
medians in microseconds, from which :func:`spread` and :func:`ratio` rebuild median and range.
"""
from __future__ import annotations

import time

import pandas as pd
import torch

from labkit.device import select_device
from labkit.graphs import GraphPool, capture_graph
from labkit.lessons.cuda_graphs.decode_stack import DecodeStack
from labkit.measure.rounds import Spread, interleaved

FULL = {"n_layers": 8, "width": 2048, "n_heads": 16, "context": 256}
SMALL = {"n_layers": 2, "width": 256, "n_heads": 4, "context": 32}
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BATCHES = (1, 2, 3, 4, 8, 12, 16, 32, 64, 100, 128, 256)
# (batch, bucket): a launch-bound step padded a little, and a GPU-bound one padded nearly 2x
LAUNCH_BOUND_PADDING = (12, 16)
GPU_BOUND_PADDING = (2049, 4096)
CONTEXT_BATCHES, CONTEXT_BUCKETS = (1, 8, 64, 256), (256, 1024)
ROUNDS = 5


def make_stack(device, quick: bool = False, max_batch: int = 256, **sizes) -> DecodeStack:
    """The notebook's decode stack (``FULL`` on a GPU, ``SMALL`` with ``quick``); ``sizes``
    override its dimensions (``context=1024``)."""
    dev = select_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return DecodeStack(**{**(SMALL if quick else FULL), **sizes}, max_batch=max_batch,
                       dtype=dtype, device=dev)


def hidden(stack: DecodeStack, batch: int) -> torch.Tensor:
    """A batch of hidden states for ``stack``: [batch, width]."""
    p = next(stack.parameters())
    return torch.randn(batch, stack.layers[0].norm1.numel(), device=p.device, dtype=p.dtype)


def spread(per_round_us) -> Spread:
    return Spread.of(per_round_us)


def ratio(top_us, bottom_us) -> Spread:
    """Per-round ``top / bottom`` (both timed in the same rounds): median and range."""
    return Spread.of([a / b for a, b in zip(top_us, bottom_us)])


def _per_round(rounds, cases) -> dict:
    return {case: list(rounds.us(case).values) for case in cases}


def gpu_busy_us(fn, device) -> float:
    """How long the GPU was busy (kernels and copies) during one call of ``fn``, from the
    profiler: the work itself, without the host time around it."""
    from labkit.measure.profile import trace

    return float(trace(fn, device=device).summary["gpu_busy_us"])


def step_rounds(stack: DecodeStack, batches=STEP_BATCHES, pool: GraphPool | None = None,
                rounds: int = ROUNDS, repeats: int = 10, warmup: int = 2,
                profile: bool = False) -> dict:
    """Per batch size: one decode step eager and (with a captured ``pool``) replayed, timed
    alternately in ``rounds`` rounds; with ``profile`` also each one's GPU busy time."""
    graphs = pool is not None and pool.enabled
    out = {"batch": [], "bucket": [], "eager_us": [], "graph_us": [], "eager_gpu_us": [],
           "graph_gpu_us": [], "rounds": rounds}
    for b in batches:
        x = hidden(stack, b)
        cases = {"eager": lambda x=x: stack(x)}
        if graphs:
            cases["graph"] = lambda x=x: pool(x)
        r = interleaved(cases, rounds=rounds, device=x.device, warmup=warmup, repeats=repeats)
        per = _per_round(r, cases)
        out["batch"].append(int(b))
        out["eager_us"].append(per["eager"])
        out["graph_us"].append(per.get("graph"))
        out["bucket"].append(pool.key_for(b)[0] if graphs else None)
        out["eager_gpu_us"].append(gpu_busy_us(cases["eager"], x.device) if profile else None)
        out["graph_gpu_us"].append(gpu_busy_us(cases["graph"], x.device)
                                   if profile and graphs else None)
    return out


def step_table(steps: dict) -> pd.DataFrame:
    """One row per batch: medians with their ranges over rounds, and the speed-up per round."""
    rows = []
    for i, b in enumerate(steps["batch"]):
        eager = spread(steps["eager_us"][i])
        row = {"batch": b, "eager_us": eager.median, "eager_low": eager.low,
               "eager_high": eager.high, "eager_gpu_us": steps["eager_gpu_us"][i]}
        if steps["graph_us"][i] is not None:
            graph, gain = spread(steps["graph_us"][i]), ratio(steps["eager_us"][i],
                                                              steps["graph_us"][i])
            row.update(bucket=steps["bucket"][i], graph_us=graph.median, graph_low=graph.low,
                       graph_high=graph.high, graph_gpu_us=steps["graph_gpu_us"][i],
                       speedup=gain.median, speedup_low=gain.low, speedup_high=gain.high)
        rows.append(row)
    return pd.DataFrame(rows).dropna(axis=1, how="all")


def padding_price(stack: DecodeStack, batch: int, bucket: int, rounds: int = ROUNDS,
                  repeats: int = 10) -> dict:
    """``batch`` rows three ways, alternating in rounds: eager, replayed from a graph captured
    at exactly ``batch`` rows, and padded up to a ``bucket``-row graph; each with its GPU busy
    time. Padded against exact is what the padding rows cost; padded against eager is whether
    the graph still pays."""
    if bucket < batch:
        raise ValueError(f"bucket {bucket} must hold the batch of {batch} rows")
    x = hidden(stack, batch)
    exact, padded = GraphPool(stack, buckets=(batch,)), GraphPool(stack, buckets=(bucket,))
    exact.capture(x)
    padded.capture(x)
    cases = {"eager": lambda: stack(x), "exact": lambda: exact(x), "padded": lambda: padded(x)}
    r = interleaved(cases, rounds=rounds, device=x.device, repeats=repeats)
    return {"batch": batch, "bucket": bucket, "rounds": _per_round(r, cases),
            "gpu_us": {case: gpu_busy_us(fn, x.device) for case, fn in cases.items()}}


def pool_overhead(stack: DecodeStack, batch: int = 8, rounds: int = ROUNDS,
                  repeats: int = 50) -> dict:
    """The pool's call (copy in, pick the bucket, replay, slice) against a bare CUDAGraph replay
    of the same bucket, all four alternating in rounds."""
    x = hidden(stack, batch)
    static = x.clone()
    bare, _ = capture_graph(lambda: stack(static))
    views = GraphPool(stack, buckets=(batch,), copy_outputs=False)
    owned = GraphPool(stack, buckets=(batch,))
    views.capture(x)
    owned.capture(x)
    cases = {"bare_replay": bare.replay,
             "bare_copy_and_replay": lambda: (static.copy_(x), bare.replay()),
             "pool_views": lambda: views(x), "pool_owned": lambda: owned(x)}
    r = interleaved(cases, rounds=rounds, device=x.device, repeats=repeats)
    return {"batch": batch, "rounds": _per_round(r, cases)}


def overhead_vs_bare(overhead: dict) -> Spread:
    """The pool's call over a bare replay, minus one, per round (0.02: 2% slower)."""
    per = overhead["rounds"]
    return Spread.of([v - 1 for v in ratio(per["pool_views"], per["bare_replay"]).values])


def capture_rounds(fn, example: torch.Tensor, buckets=BUCKETS, context_buckets=None,
                   rounds: int = 3) -> dict:
    """Capture every key of a fresh pool, ``rounds`` times: per round the total time, the
    memory the graphs hold and each key's capture time and pool growth; and the prediction
    from one eager run at the largest key."""
    out = {"buckets": list(buckets), "context_buckets": list(context_buckets or []),
           "capture_s": [], "captured_MiB": [], "per_key": []}
    for _ in range(rounds):
        pool = GraphPool(fn, buckets=buckets, context_buckets=context_buckets)
        predicted = pool.predict_memory(example)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool.capture(example)
        out["capture_s"].append(time.perf_counter() - t0)
        out["captured_MiB"].append(pool.stats.captured_bytes / 2**20)
        table = pool.stats.table()
        out["per_key"].append({"key": [str(k) for k in table.key],
                               "capture_ms": table.capture_ms.tolist(),
                               "pool_MiB": table.pool_MiB.tolist()})
        out["predicted_MiB"] = predicted / 2**20
        out["static_input_MiB"] = pool.stats.static_input_bytes / 2**20
        out["keys"] = len(pool.stats.buckets)
        del pool
    return out


def per_key_table(capture: dict) -> pd.DataFrame:
    """Per captured key: capture time (median and range over rounds) and pool growth."""
    keys = capture["per_key"][0]["key"]
    rows = []
    for i, key in enumerate(keys):
        ms = spread([r["capture_ms"][i] for r in capture["per_key"]])
        rows.append({"key": key, "capture_ms": ms.median, "capture_ms_low": ms.low,
                     "capture_ms_high": ms.high,
                     "pool_MiB": max(r["pool_MiB"][i] for r in capture["per_key"])})
    return pd.DataFrame(rows)


def context_pool(stack: DecodeStack, batches=CONTEXT_BATCHES, context_buckets=CONTEXT_BUCKETS,
                 rounds: int = 3, batch: int = 8) -> dict:
    """A pool keyed by (batch bucket, context bucket) over a stack that attends over the
    context it is given, against the same batches keyed by batch alone; and whether the graph
    of the longer context really attends over it: its output against eager at that context and
    against the shorter context's graph."""
    x = hidden(stack, 1)

    def step(x, context_bucket):
        return stack(x, context=context_bucket)

    keyed = capture_rounds(step, x, batches, context_buckets, rounds)
    batch_only = capture_rounds(stack, x, batches, None, rounds)
    pool = GraphPool(step, buckets=batches, context_buckets=context_buckets)
    xb = hidden(stack, batch)
    short, long = context_buckets[0], context_buckets[-1]
    replay_long = pool(xb, context=long).float()
    replay_short = pool(xb, context=short).float()
    eager_long = stack(xb, context=long).float()
    keyed["honoured"] = {
        "batch": batch, "short": short, "long": long,
        "diff_vs_eager": float((replay_long - eager_long).abs().max()),
        "diff_vs_short_graph": float((replay_long - replay_short).abs().max())}
    return {"keyed": keyed, "batch_only": batch_only}


def _record_pool() -> dict:
    """What the notebook measures on the full-size stack with its buckets."""
    from labkit.measure.profile import trace

    stack = make_stack("cuda", max_batch=max(BUCKETS))
    pool = GraphPool(stack, buckets=BUCKETS)
    x = hidden(stack, 8)
    pool.capture(x)
    return {"model": FULL, "buckets": list(BUCKETS),
            "step_rounds": step_rounds(stack, STEP_BATCHES, pool, profile=True),
            "trace_eager": trace(lambda: stack(x), device=x.device).to_dict(),
            "trace_graph": trace(lambda: pool(x), device=x.device).to_dict(),
            "overhead_rounds": pool_overhead(stack),
            "capture_rounds": capture_rounds(stack, hidden(stack, 1), BUCKETS),
            "padding": {"launch_bound": padding_price(stack, *LAUNCH_BOUND_PADDING)}}


def record() -> dict:
    """`make record`: every measurement the notebook shows, each stack freed before the next
    (the GPU-bound padding stack caches thousands of rows)."""
    data = _record_pool()
    torch.cuda.empty_cache()
    data["padding"]["gpu_bound"] = padding_price(
        make_stack("cuda", max_batch=GPU_BOUND_PADDING[1]), *GPU_BOUND_PADDING)
    torch.cuda.empty_cache()
    data["context_pool"] = context_pool(make_stack("cuda", max_batch=max(CONTEXT_BATCHES),
                                                   context=max(CONTEXT_BUCKETS)))
    return data


def padding_table(padding: dict) -> pd.DataFrame:
    """Per padding configuration: each way of running the batch, median and range over rounds,
    and the GPU's busy time for it."""
    rows = []
    for name, p in padding.items():
        for case, per_round in p["rounds"].items():
            s = spread(per_round)
            rows.append({"configuration": name, "batch": p["batch"],
                         "rows computed": p["bucket"] if case == "padded" else p["batch"],
                         "run": case, "wall_us": s.median, "low_us": s.low, "high_us": s.high,
                         "gpu_busy_us": p["gpu_us"][case]})
    return pd.DataFrame(rows)


def recorded_field(rec, key: str, buckets=None):
    """``rec.data[key]``, or None with a line that says what is missing: a recording made
    before the recorder measured ``key`` (or for other ``buckets``) is not read as if it had."""
    if rec is None:
        return None
    if key not in rec.data:
        print(f"the recording has no {key!r} (it predates that measurement): re-record with "
              "`make record` on a GPU host (python -m labkit.tools.record cuda_graphs/pool)")
        return None
    value = rec.data[key]
    if buckets is not None and value.get("buckets") != list(buckets):
        print(f"the recording's {key!r} covers buckets {value.get('buckets')}, this notebook's "
              f"BUCKETS are {list(buckets)}: not shown")
        return None
    return value
