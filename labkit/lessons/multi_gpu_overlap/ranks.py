"""What every rank runs: the schedules checked against the whole layer on one device, timed in
interleaved rounds (the same shuffled order on every rank: each collective needs all of them),
and traced once. :class:`SequentialStep` splits the overlapped schedule's work into its compute
and its communication, one after the other, as they cost inside a step: the two terms of the
bounds in :mod:`~labkit.lessons.multi_gpu_overlap.metrics`. Timed alone, each back to back for
many repetitions, a part costs more than inside a step, and bounds built on it would be passed.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from labkit.distributed.rank_runner import pick_backend, run_ranks
from labkit.distributed.tensor_parallel import (
    DTYPES,
    TensorParallelMLP,
    full_weights,
    make_input,
    mlp_reference,
    token_chunks,
)
from labkit.lessons.multi_gpu_overlap.experiment import TPExperiment
from labkit.lessons.multi_gpu_overlap.result import TPResult
from labkit.measure import bench
from labkit.measure.profile import trace
from labkit.measure.rounds import interleaved


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class SequentialStep:
    """The overlapped schedule's work without its overlap: all chunks' matmuls, then all their
    all-reduces, a clock mark between the two. Its two halves are the bound's compute and comm,
    as they cost inside a step. Not timed alone: each part run back to back for many
    repetitions can cost more than it does inside a step (a serial step shorter than
    compute alone + comm alone), and a bound built on such parts is passed by a measurement
    error that reads as an achievement. ``parts`` gathers one (compute, comm) median pair per
    :meth:`time` call."""

    def __init__(self, layer: TensorParallelMLP, x: torch.Tensor, num_chunks: int):
        self.layer, self.x, self.num_chunks = layer, x, num_chunks
        self.chunks = token_chunks(x.shape[0], num_chunks)
        self.parts: list[tuple[float, float]] = []

    def __call__(self, marks=None) -> torch.Tensor:
        mark = marks or (lambda i: None)
        y = self.x.new_empty(self.x.shape[0], self.layer.cfg.hidden)
        mark(0)
        for rows in self.chunks:
            self.layer.partial(self.x[rows], out=y[rows])
        mark(1)
        works = [dist.all_reduce(y[rows], group=self.layer.group, async_op=True)
                 for rows in self.chunks]
        for work in works:  # wait() holds the current stream until NCCL's is done: mark 2 follows
            work.wait()
        mark(2)
        return y

    def time(self, *, device, warmup: int, repeats: int) -> bench.Timing:
        """The whole step's timing; the halves' medians go to ``parts``."""
        for _ in range(warmup):
            self()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)]
                      for _ in range(repeats)]
            for ev in events:
                self(lambda i, ev=ev: ev[i].record())
            torch.cuda.synchronize(device)
            spans = [(a.elapsed_time(b) * 1e3, b.elapsed_time(c) * 1e3) for a, b, c in events]
            method = "cuda events"
        else:
            spans = []
            for _ in range(repeats):
                t = [0.0, 0.0, 0.0]
                self(lambda i, t=t: t.__setitem__(i, time.perf_counter()))
                spans.append(((t[1] - t[0]) * 1e6, (t[2] - t[1]) * 1e6))
            method = "perf_counter"
        compute, comm, total = (sorted(xs) for xs in zip(*((a, b, a + b) for a, b in spans)))
        self.parts.append((statistics.median(compute), statistics.median(comm)))
        return bench.Timing(median_us=statistics.median(total), p20_us=_at(total, 0.2),
                            p80_us=_at(total, 0.8), min_us=total[0], repeats=repeats,
                            device=str(device), method=method)


def _at(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[round(q * (len(sorted_xs) - 1))]


def _together(fn, *, device, warmup: int, repeats: int) -> bench.Timing:
    """Both ranks start each measurement together (a collective waits for its peer)."""
    dist.barrier()
    if isinstance(fn, SequentialStep):
        return fn.time(device=device, warmup=warmup, repeats=repeats)
    return bench.measure(fn, device=device, warmup=warmup, repeats=repeats)


def experiment_rank(ctx, exp: TPExperiment) -> dict:
    """On one rank (inside ``run_ranks``): outputs against the single-device reference; every
    schedule timed in ``exp.rounds`` shuffled rounds (the same order on every rank: one seed);
    then one serial and one overlapped step traced."""
    cfg, dtype = exp.layer_config(ctx.world_size), DTYPES[exp.dtype]
    w1, w2 = full_weights(cfg)
    layer = TensorParallelMLP(cfg, ctx.rank, device=ctx.device, dtype=dtype, weights=(w1, w2))
    x = make_input(exp.tokens, exp.hidden, exp.seed + 1, dtype, ctx.device)
    # The reference sees the same rounded weights: what is left is the layer's own rounding.
    ref = mlp_reference(x.float(), *(w.to(ctx.device, dtype).float() for w in (w1, w2)))
    errors = {"serial": _relative_error(layer.forward_serial(x), ref)}
    for k in exp.chunk_counts:
        errors[f"overlapped, {k} chunks"] = _relative_error(layer.forward_overlapped(x, k), ref)
        errors[f"sequential, {k} chunks"] = _relative_error(SequentialStep(layer, x, k)(), ref)
    del w1, w2, ref

    cases, steps = {"serial": lambda: layer.forward_serial(x)}, {}
    for k in exp.chunk_counts:
        cases[f"overlapped {k}"] = lambda k=k: layer.forward_overlapped(x, k)
        cases[f"sequential {k}"] = steps[k] = SequentialStep(layer, x, k)
    timed = interleaved(cases, rounds=exp.rounds, shuffle=True, seed=exp.seed,
                        device=ctx.device, warmup=exp.warmup, repeats=exp.repeats,
                        timer=_together)
    rounds = {case: list(timed.us(case).values) for case in cases}
    for k, step in steps.items():
        rounds[f"compute {k}"] = [c for c, _ in step.parts]
        rounds[f"comm {k}"] = [m for _, m in step.parts]
    traces = {}
    for mode, fn in (("serial", lambda: layer.forward_serial(x)),
                     ("overlapped", lambda: layer.forward_overlapped(x, exp.trace_chunks))):
        dist.barrier()
        traces[mode] = trace(fn, device=ctx.device, warmup=1).to_dict()
    return {"rank": ctx.rank, "device": str(ctx.device), "rounds": rounds,
            "orders": [list(o) for o in timed.orders], "errors": errors, "traces": traces}


def run_experiment(exp: TPExperiment, world_size: int = 2, backend: str = "auto",
                   timeout_s: float = 600.0) -> TPResult:
    """Spawn ``world_size`` ranks (or join torchrun's) and run :func:`experiment_rank` on each."""
    exp.layer_config(world_size)  # a bad size fails here, not in every child
    backend = pick_backend(backend, world_size)
    ranks = run_ranks(experiment_rank, exp, world_size=world_size, backend=backend,
                      timeout_s=timeout_s)
    return TPResult(exp, backend, ranks)
