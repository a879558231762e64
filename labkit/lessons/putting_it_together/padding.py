"""Padding to graph buckets: what the engine's cheaper launches cost in rows, and in time.

A decode graph is captured for a fixed batch, so the engine captures a few buckets and pads each
decode-only batch up to the smallest that holds it; the padded rows go through every matmul and
are thrown away. The scheduler fixes every batch before the model runs and batch sizes depend
only on lengths, so :func:`simulate_schedule` replays a workload's schedule with no model, and
:func:`bucket_costs` counts each bucket set's padded rows from it (the scheduler counts the same:
``StepStats.padded_rows``). More buckets pad fewer rows but cost capture time and graph memory.

Rows are not time. :func:`decode_step_times` times one decode step per batch size, eager and
replayed from a graph captured at exactly that size; :func:`bucket_costs` prices each set's steps
with those times. While a step is bound by reading the weights (or, eager, by the host launching
its ops) extra rows ride along on the same reads; once the matmuls count they cost time.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from labkit.engine import LLM
from labkit.engine.runner import PAD
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.graphs import GraphPool
from labkit.graphs.bucket_planner import padding_waste, plan_buckets, powers_of_two
from labkit.kvcache import BlockManager
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.measure.profile import trace

# The columns of bucket_costs that count (graphs, steps, rows): integers, never 150.0.
COUNTS = ("graphs", "decode_steps", "padded_rows")


def simulate_schedule(workload: Workload, buckets: tuple[int, ...] | None = None, *,
                      max_num_seqs: int | None = None, block_size: int = 16) -> pd.DataFrame:
    """The scheduler's step statistics for ``workload`` without running a model (every sampled
    token is 0, no stop tokens): batch sizes depend only on lengths, not on token values."""
    opts = engine_options(workload, block_size)
    seqs = max_num_seqs or opts["max_num_seqs"]
    sched = Scheduler(SchedulerConfig(
        max_num_batched_tokens=max(opts["max_num_batched_tokens"], seqs), max_num_seqs=seqs,
        max_model_len=opts["max_model_len"], decode_buckets=buckets),
        BlockManager(opts["num_blocks"], block_size, enable_prefix_caching=False))
    for i, (n, out) in enumerate(zip(*workload.lengths())):
        sched.add_request(i, [0] * n, max_tokens=out)
    while sched.has_unfinished_requests():
        step = sched.schedule()
        sched.update(step, [0] * step.num_sampled)
    return sched.history_table()


def decode_batches(history: pd.DataFrame) -> list[int]:
    """Batch size of every decode-only step (the steps a decode graph serves)."""
    only = history[(history.num_prefill_tokens == 0) & (history.num_decode_seqs > 0)]
    return [int(b) for b in only.num_decode_seqs]


def vllm_sizes(top: int) -> tuple[int, ...]:
    """vLLM's default capture sizes, cut at the first that holds ``top``: 1, 2, 4, then every
    8 up to 256, then every 16 (``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max(top, 256) + 16, 16)]
    return tuple(s for s in sizes if s < top) + (next(s for s in sizes if s >= top),)


def bucket_sets(batches: list[int]) -> dict[str, tuple[int, ...]]:
    """The bucket sets the padding study compares, each covering the largest batch: one graph
    per size (no padding, the most graphs), powers of two, vLLM's default sizes, the 4 that
    :func:`~labkit.graphs.bucket_planner.plan_buckets` picks from these batches (the fewest
    padded rows any 4 graphs allow), 1-8-max, and one graph for the largest batch."""
    top = max(batches)
    return {"one per size": tuple(range(1, top + 1)), "powers of two": powers_of_two(top),
            "vLLM default sizes": vllm_sizes(top),
            "planned, 4 graphs": plan_buckets(batches, max_graphs=4).buckets,
            "1, 8, max": tuple(sorted({1, min(8, top), top})), "max only": (top,)}


def bucket_costs(batches: list[int], sets: dict[str, tuple[int, ...]],
                 step_times: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per bucket set: graphs, padded rows, and with ``step_times`` (batch, eager_ms, graph_ms,
    measured at exact batch sizes, interpolated between, the nearest one beyond) what the decode
    steps cost eager, as graphs padded to their buckets, and what the padding costs.

    ``padding_share`` is the padding's cost against the replayed steps at their exact sizes: the
    baseline is the graph itself, so it holds whatever eager costs. ``gain_eaten`` is the
    padding's share of the gain over eager wall time; an eager decode step is host-bound (its
    GPU kernel time is far below its wall time), so that gain, and this share, depend on how
    fast the host launches, not on the GPU."""
    rows = []
    for name, buckets in sets.items():
        plan = padding_waste(batches, buckets)
        row = {"buckets": name, "graphs": len(plan.buckets), "decode_steps": len(batches),
               "padded_rows": plan.padded_rows, "waste": plan.waste}
        if step_times is not None and step_times.graph_ms.notna().all():
            t = step_times.sort_values("batch")
            eager = np.interp(batches, t.batch, t.eager_ms)
            exact = np.interp(batches, t.batch, t.graph_ms)
            padded = np.interp([next(b for b in plan.buckets if b >= x) for x in batches],
                               t.batch, t.graph_ms)
            row.update(eager_ms=eager.sum(), graph_ms=padded.sum(),
                       padding_ms=(padded - exact).sum(), gain_ms=(eager - padded).sum())
            row["padding_share"] = row["padding_ms"] / exact.sum()
            row["gain_eaten"] = row["padding_ms"] / (row["padding_ms"] + row["gain_ms"])
        rows.append(row)
    return pd.DataFrame(rows).astype({c: "int64" for c in COUNTS})


def padding_study(workload: Workload, step_times: pd.DataFrame | None = None
                  ) -> tuple[list[int], pd.DataFrame]:
    """The scheduler's decode batches for ``workload`` (no model run), and each bucket set's
    padding, priced with ``step_times`` where given (:func:`bucket_costs`)."""
    seen = decode_batches(simulate_schedule(workload))
    return seen, bucket_costs(seen, bucket_sets(seen), step_times)


def step_padding(batches: list[int], buckets) -> pd.DataFrame:
    """One row per decode step a graph serves: its batch, the bucket it replays (the smallest
    that holds it) and the rows padded; a batch above every bucket runs eagerly, no row."""
    buckets = sorted(set(buckets))
    rows = [(b, next(k for k in buckets if k >= b)) for b in batches if b <= buckets[-1]]
    table = pd.DataFrame(rows, columns=["batch", "bucket"], dtype="int64")
    return table.assign(padded=table.bucket - table.batch)


def _dense(inputs, top: int):
    """The step inputs cut to their first ``top`` rows (a graph replays from its own copy)."""
    return tuple(x[:top] for x in inputs)


def decode_step_inputs(llm: LLM, batch: int, context_len: int) -> tuple[torch.Tensor, ...]:
    """``runner.decode_forward``'s inputs for ``batch`` rows of ``context_len`` tokens of
    context each (all rows reading the same blocks), for timing: every slot is PAD, so a step
    reads the cache and writes nothing."""
    r, dev = llm.runner, llm.device
    width = r.max_blocks_per_seq
    n_blocks = math.ceil(context_len / r.block_size)
    if n_blocks > min(width, r.num_blocks):
        raise ValueError(f"context_len {context_len} needs {n_blocks} blocks; this engine has "
                         f"{r.num_blocks} (max {width} per sequence): use a shorter context")
    ids = torch.zeros(batch, dtype=torch.int32, device=dev)
    pos = torch.full_like(ids, context_len - 1)
    slots = torch.full_like(ids, PAD)
    tables = torch.full((batch, width), PAD, dtype=torch.int32, device=dev)
    tables[:, :n_blocks] = torch.arange(n_blocks, dtype=torch.int32, device=dev)
    lens = torch.full_like(ids, context_len)
    return ids, pos, slots, tables, lens


def decode_step_times(llm: LLM, batches, context_len: int, repeats: int = 10,
                      rounds: int = 3) -> pd.DataFrame:
    """One decode step of ``llm``'s model at each batch size (every row ``context_len`` tokens of
    context), eager and replayed from a graph captured at exactly that batch, timed in
    ``rounds`` interleaved rounds (every case once a round, in a shuffled order): each time is
    the median of the round medians, ``*_low_ms``/``*_high_ms`` their range, ``*_rounds_ms``
    the round medians. On a GPU ``eager_gpu_ms`` is the profiler's kernel time of one eager
    step: beside ``eager_ms`` (wall time) it shows how host-bound the eager step is;
    ``eager_kernels`` the kernels that step launched and ``host_us_per_kernel`` its wall time
    over them (the host's cost of each launch, Python and torch included)."""
    from labkit.measure.rounds import interleaved

    r, dev = llm.runner, llm.device
    inputs = decode_step_inputs(llm, max(batches), context_len)
    pool = None
    if dev.type == "cuda" and r.backend.cuda_graphs != "never":
        pool = GraphPool(r.decode_forward, batches, pad_value=PAD)
        with torch.inference_mode():
            pool.capture(*inputs)
    cases = {}
    for b in sorted(batches):
        args = _dense(inputs, b)
        cases[f"eager/{b}"] = lambda args=args: r.decode_forward(*args)
        if pool is not None:
            cases[f"graph/{b}"] = lambda args=args: pool(*args)
    with torch.inference_mode():
        timed = interleaved(cases, rounds=rounds, shuffle=True, device=dev, repeats=repeats)
        rows = []
        for b in sorted(batches):
            row = {"batch": int(b)}
            for mode in ("eager", "graph"):
                if f"{mode}/{b}" not in cases:
                    row[f"{mode}_ms"] = float("nan")
                    continue
                spread = timed.us(f"{mode}/{b}")
                row.update({f"{mode}_ms": spread.median / 1e3, f"{mode}_low_ms": spread.low / 1e3,
                            f"{mode}_high_ms": spread.high / 1e3,
                            f"{mode}_rounds_ms": [v / 1e3 for v in spread.values]})
            if pool is not None:
                row["capture_ms"] = pool.stats.buckets[(b,)].capture_ms
            if dev.type == "cuda":
                t = trace(cases[f"eager/{b}"], device=dev, warmup=1)
                row["eager_gpu_ms"] = t.summary.get("gpu_busy_us", float("nan")) / 1e3
                row["eager_kernels"] = int(t.summary.get("kernel_count", 0))
                row["host_us_per_kernel"] = (row["eager_ms"] * 1e3 / row["eager_kernels"]
                                             if row["eager_kernels"] else float("nan"))
            rows.append(row)
    return pd.DataFrame(rows)


def step_times_figure(times: pd.DataFrame, title: str):
    """Decode step time against batch size, eager and replayed from a graph."""
    import plotly.express as px

    long = times.melt(id_vars="batch", value_vars=["eager_ms", "graph_ms"], var_name="mode",
                      value_name="ms").dropna()
    return px.line(long, x="batch", y="ms", color="mode", markers=True, log_x=True, title=title,
                   labels={"batch": "decode batch (rows)", "ms": "ms per decode step"})


def bucket_figure(costs: pd.DataFrame, title: str):
    """Per bucket set: padded rows, and where priced, the graphs' gain against the padding."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if "gain_ms" in costs:
        fig.add_bar(x=costs.buckets, y=costs.gain_ms, name="graph gain over eager (ms)")
        fig.add_bar(x=costs.buckets, y=costs.padding_ms, name="spent on padded rows (ms)")
    else:
        fig.add_bar(x=costs.buckets, y=costs.padded_rows, name="padded rows")
    fig.update_traces(text=[f"{g} graphs" for g in costs.graphs], selector={"type": "bar"})
    fig.update_layout(title=title, barmode="group", height=400)
    return fig


def step_padding_figure(batches: list[int], sets: dict[str, tuple[int, ...]], title: str,
                        names=("powers of two", "vLLM default sizes", "planned, 4 graphs",
                               "max only")):
    """Step by step along the run: the decode batch, and the rows each of ``names`` pads onto
    it (where a set's buckets leave a step's padding as the batch shrinks)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_scatter(y=batches, name="decode batch (rows)", line={"color": "black", "width": 3})
    for name in names:
        fig.add_scatter(y=step_padding(batches, sets[name]).padded, name=f"padded: {name}")
    fig.update_layout(title=title, height=400, xaxis_title="decode step",
                      yaxis_title="rows")
    return fig
