"""The engine's steps on a timeline.

With async scheduling the host schedules step N+1, builds its metadata (token ids, slot mapping,
block tables ...) in a pinned buffer and copies it to the device on a copy stream while the
device still computes step N; the compute stream waits on the copy's event, not the host. On the
timeline that is a host-to-device memcpy on its own stream lane, under kernels of the compute
lane. Decode-only steps replay a CUDA Graph: one ``cudaGraphLaunch`` on the CPU lane for the
whole forward. Each ``llm.step()`` is wrapped in an annotation so the steps can be told apart on
the CPU lane.

Reading a trace's lanes: on a GPU the compute lane is the stream with the most kernel time, the
copy stream a lane of short ``Memcpy HtoD`` events; on a CPU there are only CPU lanes, the step
annotations with the model's ops inside (:func:`timeline_numbers` unwraps them, so
``cpu_busy_fraction`` is the host's share inside the model and the rest is Python: scheduling,
metadata, sampling). The padding of those steps to graph buckets is
:mod:`~labkit.lessons.putting_it_together.padding`; :func:`record_steps` records both.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict

import pandas as pd
from torch.profiler import record_function

from labkit.device import free_memory
from labkit.engine import LLM, SamplingParams
from labkit.lessons.putting_it_together.padding import (
    bucket_costs,
    bucket_sets,
    decode_batches,
    decode_step_times,
    simulate_schedule,
)
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
