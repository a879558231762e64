"""Copies beside compute, and a serving-like loop whose CPU work overlaps the GPU's.

* :func:`copy_compute_runner` (for ``labkit.measure.profile.trace``): batches copied and
  computed on, through a :class:`Prefetcher` with or without the copy stream;
  :func:`copy_compute_overlap` measures the overlap on the timeline and
  :func:`prefetch_rounds` the Prefetcher's own accounting over interleaved rounds.
* :func:`step_times`: the CPU prepares the next batch while the GPU computes this one, timed
  in interleaved rounds against the serial loop, with the host time of every phase of a step
  and (on a GPU) each stream's busy time from the profiler: what the step is bound by.
"""
from __future__ import annotations

import functools
import statistics
import time

import pandas as pd
import torch

from labkit.device import select_device
from labkit.lessons.pinned_memory_streams.transfers import host_timer
from labkit.measure import bench, intervals
from labkit.measure.rounds import interleaved
from labkit.overlap import (
    PinnedStagingPool,
    Prefetcher,
    copy_to_host,
    start_copy_to_host,
)

MODES = ("serial", "overlapped")
# Host time per step, by phase: prepare the ids, copy them (serial: a blocking copy), launch the
# step's kernels and its readback, wait for a result, and the Prefetcher's own work (staging,
# events); drain: after the last step, waiting for the GPU to finish it.
PHASES = ("prepare", "copy", "enqueue", "wait", "other", "drain")


def compute(x: torch.Tensor, w: torch.Tensor, matmuls: int) -> torch.Tensor:
    """x: [rows, cols], w: [cols, cols] -> [rows, cols]; stands in for a model's step."""
    for _ in range(matmuls):
        x = torch.tanh(x @ w)
    return x


def weight(cols: int, device, seed: int = 1) -> torch.Tensor:
    """w: [cols, cols] with gain 2, so repeated tanh(x @ w) stays near +-1 instead of decaying
    into denormals (which a CPU computes a hundred times slower)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(cols, cols, generator=g) * (2.0 / cols**0.5)).to(device)


def host_batches(n_batches: int, rows: int, cols: int, pinned: bool, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(rows, cols, generator=g) for _ in range(n_batches)]
    return [b.pin_memory() for b in batches] if pinned else batches


def copy_compute_runner(overlap: bool, n_batches: int = 4, rows: int = 2048, cols: int = 2048,
                        matmuls: int = 2, device="auto"):
    """A zero-argument callable: copy each batch to the device and compute on it, through a
    :class:`Prefetcher` with (``overlap``) or without the copy stream. Returns the outputs."""
    dev = select_device(device)
    batches = host_batches(n_batches, rows, cols, pinned=dev.type == "cuda")
    w = weight(cols, dev)
    pool = PinnedStagingPool(2, dev)
    runner = {"prefetcher": None}

    def run() -> list[torch.Tensor]:
        runner["prefetcher"] = Prefetcher(batches, dev, overlap=overlap, pool=pool)
        return [compute(x, w, matmuls) for x in runner["prefetcher"]]

    run.last = runner   # the last run's Prefetcher, for its stats
    return run


def copy_compute_overlap(events: pd.DataFrame) -> dict:
    """From a trace's events: GPU time in copies, in kernels, and in both at once."""
    def spans(kind):
        sel = events[events.kind == kind] if len(events) else events
        return intervals.union(sel.start_us, sel.start_us + sel.dur_us) if len(sel) else []

    copies, kernels = spans("memcpy"), spans("kernel")
    busy = intervals.union(*zip(*(copies + kernels))) if copies or kernels else []
    return {"copy_us": intervals.total(copies), "compute_us": intervals.total(kernels),
            "overlapped_us": intervals.overlap(copies, kernels), "span_us": busy[-1][1] - busy[0][0] if busy else 0.0}


def _reporting_timer(fn, *, device, warmup, repeats):
    """:func:`host_timer`, keeping what ``fn.report()`` says about the round's last call."""
    timing = host_timer(fn, device=device, warmup=warmup, repeats=repeats)
    fn.reports.append(fn.report())
    return timing


def prefetch_rounds(n_batches: int = 4, rows: int = 2048, cols: int = 2048, matmuls: int = 2,
                    device="auto", rounds: int = 5, repeats: int = 3) -> pd.DataFrame:
    """The copy/compute runner with one stream and with the copy stream, in interleaved rounds:
    per mode the Prefetcher's stats of each round's last run (``{stat}_rounds``) and their
    medians. ``overlap_efficiency`` = (copy + compute - wall) / min(copy, compute)."""
    dev = select_device(device)
    cases = {}
    for overlap in (False, True):
        run = copy_compute_runner(overlap, n_batches, rows, cols, matmuls, device=dev)
        run.reports = []
        run.report = functools.partial(lambda r: r.last["prefetcher"].stats.as_dict(), run)
        cases["copy stream" if overlap else "one stream"] = run
    interleaved(cases, rounds=rounds, device=dev, warmup=1, repeats=repeats,
                timer=_reporting_timer)
    rows_out = []
    for mode, run in cases.items():
        row = {"mode": mode, "batches": n_batches, "device": str(dev)}
        for stat in ("copy_ms", "compute_ms", "wall_ms", "overlap_efficiency"):
            values = [r[stat] for r in run.reports]
            row[stat] = statistics.median(values)
            row[f"{stat}_rounds"] = values
        rows_out.append(row)
    return pd.DataFrame(rows_out)


def gpu_stream_busy(events: pd.DataFrame, steps: int) -> dict:
    """From a trace's events, per step: GPU busy time over all streams, on the compute stream
    (the lane with the most kernel time) and on the other streams (the copy stream), in ms."""
    gpu = events[events.lane.str.startswith("GPU")] if len(events) else events
    if not len(gpu):
        return {"gpu_busy_ms": None, "compute_stream_ms": None, "copy_stream_ms": None}

    def busy(sel):
        return intervals.total(intervals.union(sel.start_us, sel.start_us + sel.dur_us))

    kernels = gpu[gpu.kind == "kernel"]
    main = kernels.groupby("lane").dur_us.sum().idxmax() if len(kernels) else gpu.lane.iloc[0]
    per_step = lambda us: us / 1e3 / steps
    return {"gpu_busy_ms": per_step(busy(gpu)),
            "compute_stream_ms": per_step(busy(gpu[gpu.lane == main])),
            "copy_stream_ms": per_step(sum(busy(g) for lane, g in gpu.groupby("lane")
                                           if lane != main))}


def _prepare(step: int, tokens: int, vocab: int, prep_ms: float) -> torch.Tensor:
    t0 = time.perf_counter()
    ids = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(step))
    while (time.perf_counter() - t0) * 1e3 < prep_ms:
        pass   # stands in for scheduling, block-table updates, tokenisation: CPU work
    return ids


def _step_loop(mode: str, steps: int, forward, prepare, dev, pool):
    """A zero-argument callable running ``steps`` steps of ``mode``; each call appends its host
    time per step by phase to ``.calls`` and leaves its tokens in ``.tokens``."""
    clock = time.perf_counter

    def run():
        t = dict.fromkeys(PHASES, 0.0)

        def prepared(step):
            a = clock()
            ids = prepare(step)
            t["prepare"] += clock() - a
            return ids

        out = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = clock()
        if mode == "serial":
            for step in range(steps):
                ids = prepared(step)
                a = clock()
                ids = ids.to(dev)                            # a blocking copy
                b = clock()
                tokens = forward(ids)
                c = clock()
                out.append(copy_to_host(tokens))            # waits for this step's compute
                t["copy"] += b - a
                t["enqueue"] += c - b
                t["wait"] += clock() - c
        else:
            marks = {}

            def batches():
                for step in range(steps):
                    yield prepared(step)
                marks["drain"] = clock()                   # the Prefetcher's last fetch

            pending = None
            for ids in Prefetcher(batches(), dev, pool=pool):
                a = clock()
                now = start_copy_to_host(forward(ids))     # queued behind this step
                b = clock()
                if pending is not None:
                    out.append(pending.synchronize())      # last step's tokens, long done
                t["enqueue"] += b - a
                t["wait"] += clock() - b
                pending = now
            out.append(pending.synchronize())
            t["drain"] = clock() - marks["drain"]
        wall = clock() - t0
        t["other"] = wall - sum(t.values())
        run.calls.append({"step_ms": wall * 1e3 / steps,
                          **{f"{p}_ms": v * 1e3 / steps for p, v in t.items()}})
        run.tokens = torch.stack(out)

    run.calls = []
    return run


def _phase_timer(fn, *, device, warmup, repeats):
    """:func:`host_timer`, keeping the median phase times of the round's timed calls."""
    before = len(fn.calls)
    timing = host_timer(fn, device=device, warmup=warmup, repeats=repeats)
    timed = fn.calls[before + warmup:]
    fn.rounds.append({k: statistics.median(c[k] for c in timed) for k in timed[0]})
    return timing


def step_times(steps: int = 12, tokens: int = 256, d_model: int = 4096, vocab: int = 4096,
               prep_ms: float = 3.0, compute_ms: float = 3.0, device="auto", rounds: int = 5,
               repeats: int = 3) -> pd.DataFrame:
    """A decode-like loop: the CPU prepares token ids, the GPU runs matmuls and picks the next
    token per row, the CPU reads them back. Serial: prepare, copy, compute, wait, repeat.
    Overlapped: the next step is prepared while the GPU computes this one, and a step's tokens
    are read one step later. Both must return the same tokens.

    One row per mode: ``step_ms`` and each phase's host time per step (``{phase}_ms``), the
    median over interleaved rounds, with each round's value in ``{name}_rounds``; ``compute_ms``
    is the step's compute timed alone; on a GPU ``gpu_busy_ms``, ``compute_stream_ms`` and
    ``copy_stream_ms`` per step come from a profiler trace of the same loop."""
    dev = select_device(device)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, d_model, generator=g).to(dev)
    w = weight(d_model, dev)

    def forward(ids: torch.Tensor, matmuls: int) -> torch.Tensor:
        return (compute(emb[ids], w, matmuls) @ emb.T).argmax(dim=1)   # [tokens] next ids

    ids0 = _prepare(0, tokens, vocab, 0.0).to(dev)
    one = bench.measure(lambda: forward(ids0, 8), device=dev, warmup=2, repeats=5).median_us / 8
    matmuls = max(1, round(compute_ms * 1e3 / one))
    measured_compute_ms = bench.measure(lambda: forward(ids0, matmuls), device=dev, warmup=1,
                                        repeats=5).median_us / 1e3
    prepare = functools.partial(_prepare, tokens=tokens, vocab=vocab, prep_ms=prep_ms)
    step = functools.partial(forward, matmuls=matmuls)
    pool = PinnedStagingPool(2, dev)
    loops = {mode: _step_loop(mode, steps, step, prepare, dev, pool) for mode in MODES}
    for loop in loops.values():
        loop.rounds = []
    interleaved(loops, rounds=rounds, device=dev, warmup=1, repeats=repeats, timer=_phase_timer)
    busy = {mode: {"gpu_busy_ms": None, "compute_stream_ms": None, "copy_stream_ms": None}
            for mode in MODES}
    if dev.type == "cuda":
        from labkit.measure.profile import trace

        for mode in MODES:   # a loop of its own: the profiler's slower launches stay out of the rounds
            traced = trace(_step_loop(mode, steps, step, prepare, dev, pool), device=dev, warmup=0)
            busy[mode] = gpu_stream_busy(traced.events, steps)
    rows = []
    for mode, loop in loops.items():
        row = {"mode": mode, "prep_ms": prep_ms, "compute_ms": measured_compute_ms,
               "matmuls": matmuls, "steps": steps, "rounds": rounds, "device": str(dev)}
        for name in loop.rounds[0]:
            values = [r[name] for r in loop.rounds]
            row[name] = statistics.median(values)
            row[f"{name}_rounds"] = values
        rows.append({**row, **busy[mode]})
    df = pd.DataFrame(rows)
    df["same_tokens"] = bool(torch.equal(loops["serial"].tokens, loops["overlapped"].tokens))
    return df
