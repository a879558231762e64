"""Two views of the engine's steps: their timeline, and their padding to graph buckets.

Timeline. With async scheduling the host schedules step N+1, builds its metadata (token ids,
slot mapping, block tables ...) in a pinned buffer and copies it to the device on a copy stream
while the device still computes step N; the compute stream waits on the copy's event, not the
host. On the timeline that is a host-to-device memcpy on its own stream lane, under kernels of
the compute lane. Decode-only steps replay a CUDA Graph: one ``cudaGraphLaunch`` on the CPU
lane for the whole forward. Each ``llm.step()`` is wrapped in an annotation so the steps can be
told apart on the CPU lane.

Padding. A decode graph serves a batch padded up to its bucket: coarser buckets mean fewer
graphs (capture time, memory) but more rows computed for nothing. :func:`bucket_costs` prices
a workload's decode batches under several bucket sets from step times measured per batch size
(:func:`decode_step_times`), so the launch time a graph saves and the padding it costs are in
one table.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict

import numpy as np
import pandas as pd
import torch
from torch.profiler import record_function

from labkit.device import free_memory
from labkit.engine import LLM, SamplingParams
from labkit.engine.runner import PAD
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.graphs import GraphPool
from labkit.graphs.bucket_planner import padding_waste, plan_buckets, powers_of_two
from labkit.kvcache import BlockManager
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.measure import intervals
from labkit.measure.events import summarize
from labkit.measure.profile import Trace, trace
from labkit.tools.recorded import json_columns

STEP = "engine step"


def run_steps(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    """Add the requests, then ``llm.step()`` until all have finished; returns the steps run."""
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    steps = 0
    while llm.has_unfinished_requests():
        with record_function(f"{STEP} {steps}"):
            llm.step()
        steps += 1
    return steps


def trace_engine(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Trace:
    """Profile one run of the requests through ``llm`` (after an untraced warm-up run)."""
    if llm.has_unfinished_requests():
        raise RuntimeError("trace_engine needs an idle engine: finish the requests in flight")
    return trace(run_steps, llm, prompts, params, device=llm.device, warmup=1)


def step_overlap(events: pd.DataFrame) -> dict:
    """What the trace shows about steps, metadata copies, compute and graph replays.

    The compute stream is the GPU lane with the most kernel time; a host-to-device copy
    overlaps compute where it runs while a kernel of another lane runs.
    """
    if events.empty:
        return {"steps": 0}
    steps = events[(events.kind == "annotation") & events.name.str.startswith(STEP)]
    out: dict = {"steps": len(steps),
                 "mean_step_us": float(steps.dur_us.mean()) if len(steps) else None,
                 "graph_launches": int(((events.kind == "runtime")
                                        & events.name.str.contains("GraphLaunch")).sum())}
    if len(steps):
        out["step_us"] = [round(float(d), 1) for d in steps.sort_values("start_us").dur_us]
    kernels = events[events.kind == "kernel"]
    if kernels.empty:
        return out  # a CPU-only trace: steps and their host time are all there is
    compute_lane = kernels.groupby("lane").dur_us.sum().idxmax()
    h2d = events[(events.kind == "memcpy") & events.name.str.contains("HtoD")]
    on_side = h2d[h2d.lane != compute_lane]
    busy = intervals.union(kernels.start_us[kernels.lane == compute_lane],
                            (kernels.start_us + kernels.dur_us)[kernels.lane == compute_lane])
    overlaps = [intervals.overlap([(s, s + d)], busy) for s, d in zip(on_side.start_us, on_side.dur_us)]
    out.update({
        "compute_lane": compute_lane,
        "kernels": len(kernels),
        "h2d_copies": len(h2d),
        "h2d_on_copy_stream": len(on_side),
        "h2d_overlapping_compute": int(sum(o > 0 for o in overlaps)),
        "h2d_overlapped_us": float(sum(overlaps)),
        "h2d_us": float(on_side.dur_us.sum()),
    })
    return out


def timeline_numbers(t: Trace) -> dict:
    """The profiler's summary (GPU busy fraction, gaps ...) and :func:`step_overlap` in one.

    The summary is taken with the step annotations unwrapped, so on a CPU its top-level ops are
    the model's ops and ``cpu_busy_fraction`` the share of host time spent inside them (the
    rest is Python: scheduling, metadata, sampling)."""
    ev = t.events
    inner = ev[ev.kind != "annotation"].assign(
        depth=lambda d: (d.depth - d.lane.str.startswith("CPU")).clip(lower=0))
    return {**summarize(inner), **step_overlap(ev)}


# ---------------------------------------------------------------------- padding
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
    prompts, params = workload.requests(vocab_size=256)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sched.add_request(i, p, max_tokens=sp.max_tokens)
    while sched.has_unfinished_requests():
        step = sched.schedule()
        sched.update(step, [0] * step.num_sampled)
    return sched.history_table()


def decode_batches(history: pd.DataFrame) -> list[int]:
    """Batch size of every decode-only step (the steps a decode graph serves)."""
    only = history[(history.num_prefill_tokens == 0) & (history.num_decode_seqs > 0)]
    return [int(b) for b in only.num_decode_seqs]


def bucket_sets(batches: list[int]) -> dict[str, tuple[int, ...]]:
    top = max(batches)
    return {"one per size": tuple(range(1, top + 1)), "powers of two": powers_of_two(top),
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
    return pd.DataFrame(rows)


def _dense(inputs, top: int):
    """The step inputs cut to their first ``top`` rows (a graph replays from its own copy)."""
    return tuple(x[:top] for x in inputs)


def decode_step_times(llm: LLM, batches, context_len: int, repeats: int = 10,
                      rounds: int = 3) -> pd.DataFrame:
    """One decode step of ``llm``'s model at each batch size (every row ``context_len`` tokens of
    context), eager and replayed from a graph captured at exactly that batch, timed in
    ``rounds`` interleaved rounds (every case once a round, in a shuffled order): each time is
    the median of the round medians, ``*_low_ms``/``*_high_ms`` their range, ``*_rounds_ms``
    the round medians. On a GPU ``eager_gpu_ms`` is the profiler's kernel time of one eager
    step: beside ``eager_ms`` (wall time) it shows how host-bound the eager step is."""
    from labkit.measure.rounds import interleaved

    r, dev = llm.runner, llm.device
    top, width = max(batches), r.max_blocks_per_seq
    n_blocks = math.ceil(context_len / r.block_size)
    if n_blocks > min(width, r.num_blocks):
        raise ValueError(f"context_len {context_len} needs {n_blocks} blocks; this engine has "
                         f"{r.num_blocks} (max {width} per sequence): use a shorter context")
    ids = torch.zeros(top, dtype=torch.int32, device=dev)
    pos = torch.full_like(ids, context_len - 1)
    slots = torch.full_like(ids, PAD)  # timing only: read the cache, write nothing
    tables = torch.full((top, width), PAD, dtype=torch.int32, device=dev)
    tables[:, :n_blocks] = torch.arange(n_blocks, dtype=torch.int32, device=dev)
    lens = torch.full_like(ids, context_len)
    inputs = (ids, pos, slots, tables, lens)
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
            row = {"batch": b}
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


def record_steps(model, *, timeline: Workload | None = None, server: Workload | None = None,
                 batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), context_len: int = 512) -> dict:
    """For `make record` (through :func:`labkit.lessons.putting_it_together.experiment.record`):
    a traced run of ``timeline`` through an engine with the defaults (auto backend, graphs and
    async scheduling where there is CUDA), decode step times per batch, and ``server``'s decode
    batches priced under each bucket set."""
    timeline = timeline or Workload(num_requests=4, prompt_len=(32, 64), output_len=(4, 4),
                                    seed=1)
    server = server or Workload(num_requests=max(batches), prompt_len=(16, 256),
                                output_len=(16, 256), seed=2)
    t0 = time.perf_counter()
    llm = LLM(model, **engine_options(timeline))
    t = trace_engine(llm, *timeline.requests(model.config.vocab_size))
    del llm
    t1 = time.perf_counter()
    llm = LLM(model, enforce_eager=True, num_blocks=math.ceil(context_len / 16) + 1,
              max_num_seqs=max(batches), max_model_len=context_len,
              max_num_batched_tokens=max(2048, max(batches)))
    times = decode_step_times(llm, list(batches), context_len)
    step_backend = llm.backend
    del llm
    free_memory(model.embed_tokens.device)
    seen = decode_batches(simulate_schedule(server))
    # 3000 events keep every kernel, launch and step annotation of a 1B model's few steps
    return {"trace": t.to_dict(max_events=3000), "trace_numbers": timeline_numbers(t),
            "timeline_workload": asdict(timeline), "step_times": json_columns(times),
            "step_times_backend": step_backend, "context_len": context_len,
            "server_workload": asdict(server), "server_decode_batches": seen,
            "bucket_costs": json_columns(bucket_costs(seen, bucket_sets(seen), times)),
            "seconds": {"timeline": t1 - t0, "padding": time.perf_counter() - t1}}
