"""Notebook 09: a tensor-parallel MLP's all-reduce, serial against overlapped with the next
chunk's compute, timed on every rank in interleaved rounds and read off both ranks' timelines.

:class:`TPExperiment` is one layer size timed for several chunk counts; :func:`run_experiment`
runs it on every rank (:func:`labkit.distributed.run_ranks`); :class:`TPResult` gathers what the
ranks measured: per round the slowest rank's times, each rank's errors, and every rank's trace
on one timeline. :func:`overlap_metrics` says how well a step hid its communication and
:func:`out_of_model` which of those metrics passed the bound the model sets them.

The bound's two terms, compute and communication, are timed inside a step that runs both, one
after the other (:class:`SequentialStep`: the chunked matmuls, then their all-reduces, a clock
mark between the two), in the same rounds as the steps they bound. Timed alone, each back to
back for many repetitions, a part can cost more than it does inside a step (a serial step
shorter than compute alone + comm alone), and bounded metrics built on such parts pass 1.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass

import pandas as pd
import torch
import torch.distributed as dist

from labkit import check_positive_int
from labkit.distributed.rank_runner import pick_backend, run_ranks
from labkit.distributed.tensor_parallel import (
    DTYPES,
    TensorParallelMLP,
    TPConfig,
    full_weights,
    make_input,
    mlp_reference,
    token_chunks,
)
from labkit.measure import bench, intervals
from labkit.measure.events import EVENT_COLUMNS
from labkit.measure.profile import Trace, trace
from labkit.measure.rounds import Spread, interleaved
from labkit.teaching import claim

# No step can beat max(compute, comm), nor a k-chunk pipeline max + min / k; so efficiency,
# of_pipeline and hidden_fraction are at most 1 whatever the hardware. (hidden_fraction below 0
# is possible: overlapped, the two slowed each other more than overlap hid.)
BOUNDS = {"efficiency": 1.0, "of_pipeline": 1.0, "hidden_fraction": 1.0}
# With one chunk, or compute far above comm, a bound is met with equality: timings of the same
# work then land on both sides of it. Past it by more than this, in every round, is not noise.
BOUND_TOLERANCE = 0.03


def overlap_metrics(serial_us: float, overlapped_us: float, compute_us: float,
                    comm_us: float, num_chunks: int = 1) -> dict:
    """How well the overlapped step hides communication.

    ``efficiency = max(compute, comm) / overlapped``: 1.0 when the step takes only as long as
    the longer of the two (the shorter one entirely hidden); ``speedup = serial / overlapped``;
    ``ceiling = serial / max(compute, comm)``, the most any overlap could gain;
    ``hidden_fraction``: how much of the shorter one disappeared from the step.

    A pipeline of ``num_chunks`` equal chunks cannot reach ``max(compute, comm)``: the first
    chunk's compute runs before any all-reduce can start, the last chunk's all-reduce after all
    compute. ``pipeline_us = max + min / num_chunks`` is that bound (one chunk: the serial sum),
    and ``of_pipeline = pipeline_us / overlapped`` how close the step came to it. The bounds
    hold only when compute and comm are what they cost inside a step (:class:`SequentialStep`).
    """
    times = {"serial_us": serial_us, "overlapped_us": overlapped_us, "compute_us": compute_us,
                 "comm_us": comm_us}
    bad = {k: v for k, v in times.items() if not v > 0}
    if bad:
        raise ValueError(f"times must be positive microseconds, got {bad}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    ideal, shorter = max(compute_us, comm_us), min(compute_us, comm_us)
    pipeline = ideal + shorter / num_chunks
    return {**times, "ideal_us": ideal, "pipeline_us": pipeline,
            "efficiency": ideal / overlapped_us, "of_pipeline": pipeline / overlapped_us,
            "speedup": serial_us / overlapped_us, "ceiling": serial_us / ideal,
            "hidden_fraction": (compute_us + comm_us - overlapped_us) / shorter}


def out_of_model(spreads: dict[str, Spread]) -> list[str]:
    """The bounded metrics (:data:`BOUNDS`) that passed their bound by more than
    :data:`BOUND_TOLERANCE` in every round: a bug in the metric or in the model, never a result.
    A range that only straddles the bound is noise. hidden_fraction <= 1 is the inequality of
    efficiency <= 1 (overlapped >= max(compute, comm)) divided by the shorter side, which
    magnifies a step's noise: it is judged on the step's scale, with efficiency."""
    past = [name for name in ("efficiency", "of_pipeline")
            if name in spreads and spreads[name].above(BOUNDS[name] * (1 + BOUND_TOLERANCE))]
    return past + (["hidden_fraction"] if "efficiency" in past and "hidden_fraction" in spreads
                   else [])


def gain_verdict(gain: Spread) -> str:
    """What a speed-up's range allows one to say: a gain only when every round gained."""
    if gain.above(1.0):
        return "a gain, every round faster than the serial step"
    if gain.below(1.0):
        return "slower than the serial step in every round"
    return "within noise: the range includes no change"


@dataclass(frozen=True)
class TPExperiment:
    """One layer size, timed serial, overlapped and sequential for each chunk count in
    ``rounds`` shuffled rounds, and traced once."""
    tokens: int
    hidden: int
    ffn: int
    dtype: str = "float32"
    chunk_counts: tuple[int, ...] = (1, 2, 4, 8)
    trace_chunks: int = 4
    warmup: int = 2
    repeats: int = 10
    seed: int = 0
    rounds: int = 3

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        check_positive_int("tokens", self.tokens)
        if not self.chunk_counts:
            raise ValueError("chunk_counts needs at least one chunk count (1 is the serial "
                             "schedule)")
        for k in (*self.chunk_counts, self.trace_chunks):
            token_chunks(self.tokens, k)
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={self.repeats}, "
                             f"warmup={self.warmup}")
        if not isinstance(self.rounds, int) or self.rounds < 3:
            raise ValueError(f"rounds must be an integer >= 3 (a range over fewer says little), "
                             f"got {self.rounds!r}")

    def layer_config(self, world_size: int) -> TPConfig:
        return TPConfig(self.hidden, self.ffn, world_size, self.seed)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class SequentialStep:
    """The overlapped schedule's work without its overlap: all chunks' matmuls, then all their
    all-reduces, a clock mark between the two. Its two halves are the bound's compute and comm,
    as they cost inside a step. ``parts`` gathers one (compute, comm) median pair per
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


# Compute grows with ffn, the all-reduce ([tokens, hidden]) does not: one of these sizes puts the
# two close together on 2 GPUs over NVLink, 28672 is a Llama-70B-sized MLP. 8192 tokens is a
# prefill; decode steps carry one token per sequence, so 8 and 64 tokens are decode batches.
GPU_SHAPES = {"tokens": 8192, "hidden": 8192, "dtype": "bfloat16",
              "chunk_counts": (1, 2, 4, 8, 16), "trace_chunks": 4, "warmup": 5, "repeats": 20,
              "rounds": 5}
GPU_FFN_SIZES = (2048, 8192, 28672)
DECODE_SHAPES = {"hidden": 8192, "ffn": 28672, "dtype": "bfloat16", "chunk_counts": (1, 2, 4, 8),
                 "trace_chunks": 4, "warmup": 10, "repeats": 50, "rounds": 5}
DECODE_TOKENS = (8, 64)


def record() -> dict:
    """`make record` on a host with 2 GPUs: for each prefill-sized ffn and each decode-sized
    token count, the rounds and the traces."""
    from labkit.tools.recorded import NeedsMoreGPUs

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise NeedsMoreGPUs(f"multi_gpu_overlap needs 2 GPUs (one rank per GPU, NCCL); this machine "
                            f"has {gpus}. Run `python -m labkit.tools.record multi_gpu_overlap` on a 2-GPU host.")
    runs = [run_experiment(TPExperiment(ffn=ffn, **GPU_SHAPES), world_size=2, backend="nccl")
            for ffn in GPU_FFN_SIZES]
    decode = [run_experiment(TPExperiment(tokens=t, **DECODE_SHAPES), world_size=2,
                             backend="nccl") for t in DECODE_TOKENS]
    return {"runs": [r.to_dict() for r in runs], "decode_runs": [r.to_dict() for r in decode],
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)]}


# Fields a recording needs for each group of claims, and what each gives the notebook.
RECORDED_FIELDS = {"rounds": "interleaved rounds (gains with their ranges, metrics against "
                             "their bounds)",
                   "decode_runs": "decode-sized token counts (where overlap cannot help)"}


def missing_fields(data: dict) -> list[str]:
    """The :data:`RECORDED_FIELDS` that a recording's data lacks."""
    missing = []
    if not all("rounds" in rank for run in data.get("runs", []) for rank in run["ranks"]):
        missing.append("rounds")
    if not data.get("decode_runs"):
        missing.append("decode_runs")
    return missing


def _comm_mask(ev: pd.DataFrame) -> pd.Series:
    """NCCL kernels on a GPU trace; gloo's work (its own threads) on a CPU trace. The CPU-side
    ``c10d::allreduce_`` / ``nccl:all_reduce`` calls only enqueue the collective."""
    names = ev.name.str.lower()
    on_gpu = ev.lane.str.startswith("GPU")
    if on_gpu.any():
        return on_gpu & (ev.kind == "kernel") & names.str.contains("nccl")
    return names.str.startswith("gloo:")


def _compute_mask(ev: pd.DataFrame, comm: pd.Series) -> pd.Series:
    on_gpu = ev.lane.str.startswith("GPU")
    if on_gpu.any():
        return on_gpu & (ev.kind == "kernel") & ~comm
    comm_lanes = set(ev.lane[comm])
    return ((ev.kind == "cpu_op") & (ev.depth == 0) & ~ev.lane.isin(comm_lanes)
            & ~ev.name.str.startswith("c10d::"))


def comm_overlap(events: pd.DataFrame) -> dict:
    """One rank's trace: how much of its communication ran while it computed (what the hardware
    allowed), and how many all-reduces were launched before its last matmul (what the schedule
    asked for: 0 serial, chunks - 1 overlapped)."""
    comm = _comm_mask(events)
    busy_comm, busy_compute = (intervals.union(e.start_us, e.start_us + e.dur_us)
                               for e in (events[comm], events[_compute_mask(events, comm)]))
    comm_us = intervals.total(busy_comm)
    top = events[(events.kind == "cpu_op") & (events.depth == 0)]
    last_matmul = top.start_us[top.name.str.startswith(("aten::matmul", "aten::mm"))].max()
    return {"collectives": int(comm.sum()), "comm_us": round(comm_us, 1),
            "compute_us": round(intervals.total(busy_compute), 1),
            "comm_hidden_fraction": round(intervals.overlap(busy_comm, busy_compute) / comm_us, 3)
            if comm_us else 0.0,
            "launched_early": int((top.start_us[top.name.str.startswith("c10d::allreduce")]
                                   < last_matmul).sum())}


def merge_rank_traces(rank_traces: list[dict]) -> Trace:
    """Every rank's ``Trace.to_dict()`` on one timeline, lanes named by rank, collectives drawn
    as their own kind; ``summary["rank r"]`` is :func:`comm_overlap` of rank r. Each rank's
    clock starts at its own traced step (processes share no clock)."""
    frames, summary = [], {}
    for rank, d in enumerate(rank_traces):
        ev = pd.DataFrame(d["events"], columns=EVENT_COLUMNS)
        comm = _comm_mask(ev)
        comm_lanes = set(ev.lane[comm])
        summary[f"rank {rank}"] = comm_overlap(ev)
        ev.loc[comm, "kind"] = "collective"
        ev["lane"] = [(f"CPU rank {rank} {lane[4:]}" if lane.startswith("CPU") else
                       f"{lane} (rank {rank})") + (" comm" if lane in comm_lanes else "")
                      for lane in ev.lane]
        # Correlation ids are per process: keep rank 1's launches from linking to rank 0's kernels.
        ev["correlation"] = ev.correlation.where(ev.correlation < 0,
                                                 ev.correlation + rank * 1_000_000_000)
        frames.append(ev)
    return Trace(events=pd.concat(frames, ignore_index=True), summary=summary,
                 fingerprint=rank_traces[0].get("fingerprint", {}))


METRICS = ("serial_us", "overlapped_us", "compute_us", "comm_us", "ideal_us", "pipeline_us",
           "efficiency", "of_pipeline", "speedup", "ceiling", "hidden_fraction")


@dataclass
class TPResult:
    """Every rank's measurements of one experiment. A step ends when its slowest rank ends, so
    each round takes its step times from the slowest rank."""
    experiment: TPExperiment
    backend: str
    ranks: list[dict]

    @property
    def has_rounds(self) -> bool:
        """Timed in interleaved rounds with the in-step split; a recording without rounds holds
        one median per rank and case, its compute and comm timed alone."""
        return all("rounds" in r for r in self.ranks)

    @property
    def round_table(self) -> pd.DataFrame:
        """One row per round and chunk count, every metric computed within its round. Compute
        and comm come from the rank that finished computing last: the other rank's comm time
        holds its wait for that peer."""
        if not self.has_rounds:
            raise ValueError("this result has no rounds (one median per rank and case): "
                             "re-record it with `make record` on a 2-GPU host")
        per_rank = [r["rounds"] for r in self.ranks]
        rows = []
        for i in range(len(per_rank[0]["serial"])):
            serial = max(r["serial"][i] for r in per_rank)
            for k in self.experiment.chunk_counts:
                last = max(per_rank, key=lambda r: r[f"compute {k}"][i])
                rows.append({"round": i, "num_chunks": k, **overlap_metrics(
                    serial, max(r[f"overlapped {k}"][i] for r in per_rank),
                    last[f"compute {k}"][i], last[f"comm {k}"][i], k)})
        return pd.DataFrame(rows)

    def spreads(self, num_chunks: int) -> dict[str, Spread]:
        """Every metric at ``num_chunks`` over the rounds (one value where there are none)."""
        if self.has_rounds:
            rows = self.round_table[lambda t: t.num_chunks == num_chunks]
            return {m: Spread.of(rows[m].tolist()) for m in METRICS}
        row = self.table.set_index("num_chunks").loc[num_chunks]
        return {m: Spread.of([row[m]]) for m in METRICS}

    @property
    def table(self) -> pd.DataFrame:
        """One row per chunk count: each metric's median over the rounds, the speed-up's range,
        and the bounded metrics that passed their bound in every round (``out_of_model``)."""
        if not self.has_rounds:
            return self._single_median_table()
        rounds = self.round_table
        table = rounds.groupby("num_chunks", as_index=False)[list(METRICS)].median()
        by_k = rounds.groupby("num_chunks")
        table["speedup_low"] = by_k.speedup.min().values
        table["speedup_high"] = by_k.speedup.max().values
        table["out_of_model"] = [", ".join(out_of_model(self.spreads(int(k)))) or "-"
                                 for k in table.num_chunks]
        return table

    def _single_median_table(self) -> pd.DataFrame:
        """A recording of one median per rank and case, its columns each the slowest rank's."""
        per_rank = pd.DataFrame([row for r in self.ranks for row in r["rows"]])
        slowest = per_rank.groupby("num_chunks", as_index=False).max()
        rows = [{"num_chunks": int(r.num_chunks),
                 **overlap_metrics(r.serial_us, r.overlapped_us, r.compute_us, r.comm_us,
                                   int(r.num_chunks))}
                for r in slowest.itertuples()]
        table = pd.DataFrame(rows)
        table["out_of_model"] = [", ".join(out_of_model({n: Spread.of([row[n]]) for n in BOUNDS}))
                                 or "-" for _, row in table.iterrows()]
        return table

    @property
    def errors(self) -> pd.DataFrame:
        return pd.DataFrame({f"rank {r['rank']}": r["errors"] for r in self.ranks})

    def trace(self, mode: str) -> Trace:
        """``mode`` "serial" or "overlapped": both ranks' step on one timeline."""
        return merge_rank_traces([r["traces"][mode] for r in self.ranks])

    def to_dict(self) -> dict:
        return {"experiment": asdict(self.experiment), "backend": self.backend,
                "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict) -> TPResult:
        exp = dict(d["experiment"], chunk_counts=tuple(d["experiment"]["chunk_counts"]))
        return cls(TPExperiment(**exp), d["backend"], d["ranks"])

    def figure(self, title: str):
        """Step time per chunk count (medians over the rounds); dotted: the best overlap can do
        (max of the two), dashed: the best a pipeline of that many chunks can do."""
        import plotly.express as px

        table = self.table
        long = table.melt(id_vars=["num_chunks"], var_name="time", value_name="us", value_vars=[
            "serial_us", "overlapped_us", "compute_us", "comm_us", "ideal_us", "pipeline_us"])
        fig = px.line(long, x="num_chunks", y="us", color="time", markers=True, log_x=True,
                      title=title, labels={"num_chunks": "chunks per step", "us": "us per step"})
        fig.update_xaxes(tickvals=table.num_chunks.tolist())
        fig.update_traces(selector={"name": "pipeline_us"}, line_dash="dash")
        return fig.update_traces(selector={"name": "ideal_us"}, line_dash="dot")

    @property
    def imbalance(self) -> float:
        """|log(compute / communication)| unchunked: 0 when the two take equally long."""
        row = self.table.sort_values("num_chunks").iloc[0]
        return abs(math.log(row.compute_us / row.comm_us))

    def best_chunks(self) -> int:
        """The chunk count with the highest median speed-up over the serial step; one chunk
        (the serial step's own work, nothing overlapped) only where it is the only count."""
        table = self.table
        overlapping = table[table.num_chunks > 1] if (table.num_chunks > 1).any() else table
        return int(overlapping.loc[overlapping.speedup.idxmax()].num_chunks)

    def comm_stretch(self) -> float:
        """How much longer the communication ran in the traced overlapped step than in the
        serial one, averaged over ranks (one traced step each)."""
        serial, overlapped = (self.trace(m).summary for m in ("serial", "overlapped"))
        stretch = [overlapped[k]["comm_us"] / serial[k]["comm_us"] for k in serial
                   if serial[k]["comm_us"] > 0]
        return sum(stretch) / len(stretch) if stretch else float("nan")


def sweep_summary(results: list[TPResult]) -> pd.DataFrame:
    """One row per experiment: its best chunk count and what that step achieved (medians, the
    speed-up's range where there are rounds), and ``comm_stretch``: communication that shares
    the GPU with matmuls runs slower."""
    rows = []
    for r in results:
        table, e = r.table, r.experiment
        best = table.set_index("num_chunks").loc[r.best_chunks()]
        one = table.loc[table.num_chunks.idxmin()]
        rows.append({"tokens": e.tokens, "ffn": e.ffn,
                     "compute_over_comm": one.compute_us / one.comm_us,
                     "serial_us": one.serial_us, "best_chunks": r.best_chunks(),
                     "best_overlapped_us": best.overlapped_us, "speedup": best.speedup,
                     **({"speedup_low": best.speedup_low, "speedup_high": best.speedup_high}
                        if r.has_rounds else {}),
                     "ceiling": best.ceiling, "efficiency": best.efficiency,
                     "of_pipeline": best.of_pipeline, "comm_stretch": r.comm_stretch()})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------- what the notebook claims
SIDE_BY_SIDE = 0.25      # share of NCCL's kernel time that must run beside a matmul, every rank
LATENCY_FACTOR = 4.0     # how much faster per byte a prefill all-reduce must run than a decode one


def where_of(backend: str, recorded=None, gpu: str | None = None) -> str:
    """'on 2 x NVIDIA H200' (recorded or live over NCCL) or 'on this machine's CPU (gloo)'."""
    if recorded is not None:
        return f"on 2 x {recorded.fingerprint['gpu']} (recorded)"
    return f"on 2 x {gpu}" if backend == "nccl" else "on this machine's CPU (gloo)"


def split_claim(one_partial_off: float, sum_off: float):
    """The two partials need each other: one alone is far from y, their sum is y."""
    return claim("One rank's partial alone misses the layer's output by up to {one:.3f}; the two "
                 "partials summed match it to {both:.1e}: the output needs exactly one "
                 "all-reduce.", sum_off < 1e-5 < one_partial_off, one=one_partial_off,
                 both=sum_off)


def correctness_claim(errors: pd.DataFrame, tol: float, dtype: str, where: str):
    worst = float(errors.max().max())
    return claim("Every schedule, on both ranks {where}, matches the whole layer on one device: "
                 "worst relative error {worst:.1e}, under the {tol:.0e} that {dtype} allows.",
                 worst < tol, where=where, worst=worst, tol=tol, dtype=dtype)


def schedule_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """What the traced steps launched, on every rank of every result: the serial step one
    all-reduce after its last matmul, the overlapped one all but its last chunk's before."""
    serial = [s for r in results for s in r.trace("serial").summary.values()]
    chunks = {r.experiment.trace_chunks for r in results}
    overlapped = [(r.experiment.trace_chunks, s) for r in results
                  for s in r.trace("overlapped").summary.values()]
    return [
        claim("The traced serial step {where} ran one all-reduce per rank, launched after the "
              "last matmul: {early} launched early.",
              all(s["collectives"] == 1 and s["launched_early"] == 0 for s in serial),
              where=where, early=max(s["launched_early"] for s in serial), recorded=recorded),
        claim("The traced overlapped step {where} ran {chunks} all-reduces per rank and "
              "launched {early} of them before the last matmul: each chunk's sum was in flight "
              "while a later chunk computed.",
              all(s["collectives"] == k and s["launched_early"] == k - 1 for k, s in overlapped),
              where=where, chunks="/".join(map(str, sorted(chunks))),
              early="/".join(sorted({str(s["launched_early"]) for _, s in overlapped})),
              recorded=recorded)]


def gpu_trace_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """On GPU traces: NCCL ran beside the matmuls, and ran longer there than alone."""
    hidden = [s["comm_hidden_fraction"] for r in results
              for s in r.trace("overlapped").summary.values()]
    stretch = [r.comm_stretch() for r in results]
    return [
        claim("In the traced overlapped step {where}, NCCL's kernels ran beside a matmul for "
              "{lo:.0%}-{hi:.0%} of their time, on both ranks at every width (at least "
              "{target:.0%} asked): the GPU ran the two side by side.",
              min(hidden) >= SIDE_BY_SIDE, where=where, lo=min(hidden), hi=max(hidden),
              target=SIDE_BY_SIDE, recorded=recorded),
        claim("Beside matmuls, NCCL's kernels ran {lo:.2f}-{hi:.2f}x as long as alone in the "
              "serial step {where} (one traced step per width): communication that shares the "
              "GPU gets fewer SMs and less memory bandwidth, and waits for its peer's chunk.",
              min(stretch) > 1.0, lo=min(stretch), hi=max(stretch), where=where,
              recorded=recorded)]


def width_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """Across MLP widths at one token count: compute grows with ffn, the all-reduce does not;
    and cut into more chunks, the all-reduces cost more in total."""
    results = sorted(results, key=lambda r: r.experiment.ffn)
    ones = [r.table.sort_values("num_chunks").iloc[0] for r in results]
    ratios = [o.compute_us / o.comm_us for o in ones]
    comm = [o.comm_us for o in ones]
    k = min(max(r.experiment.chunk_counts) for r in results)
    cut = [r.table.set_index("num_chunks").loc[k].comm_us / o.comm_us
           for r, o in zip(results, ones)]
    return [
        claim("Compute grows with the MLP width, the all-reduce does not {where}: compute / "
              "comm is {lo:.2f} at ffn {a:,} and {hi:.1f} at ffn {b:,}, while the all-reduce of "
              "[tokens, hidden] takes {cmin:.0f}-{cmax:.0f} us at every width.",
              all(x < y for x, y in itertools.pairwise(ratios)) and max(comm) / min(comm) < 1.2,
              where=where, lo=ratios[0], a=results[0].experiment.ffn, hi=ratios[-1],
              b=results[-1].experiment.ffn, cmin=min(comm), cmax=max(comm), recorded=recorded),
        claim("Cut into {k} chunks, the all-reduces take {lo:.2f}-{hi:.2f}x one message's time "
              "{where}: a finer pipeline pays for each piece it hides.", min(cut) > 1.1, k=k,
              lo=min(cut), hi=max(cut), where=where, recorded=recorded)]


def rounds_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """From interleaved rounds: no bounded metric is out of model; per result, the best chunk
    count's speed-up with its range, called a gain only when every round gained, and never above
    its ceiling serial / max(compute, comm)."""
    out, medians, noisy = [], [], 0
    for r in results:
        for k in r.experiment.chunk_counts:
            spreads = r.spreads(k)
            out += [f"ffn {r.experiment.ffn}, {r.experiment.tokens} tokens, {k} chunks: {name} "
                    f"{spreads[name]:.3f}" for name in out_of_model(spreads)]
            medians += [(name, spreads[name].median) for name in BOUNDS]
            noisy += sum(spreads[name].median > bound and name not in out_of_model(spreads)
                         for name, bound in BOUNDS.items())
    largest = {name: max(v for n, v in medians if n == name) for name in BOUNDS}
    made = [claim("{verdict} {where}: efficiency and of_pipeline, each at most 1 by the model, "
                  "passed 1 by more than {tol:.0%} (timing noise) in every round at no chunk "
                  "count, nor did hidden_fraction, whose bound is efficiency's (largest medians "
                  "{eff:.3f}, {pipe:.3f}, {hid:.3f}{noisy}).{out}", not out, tol=BOUND_TOLERANCE,
                  verdict="No bounded metric is out of model" if not out else
                  "Some bounded metrics are out of model", where=where,
                  eff=largest["efficiency"], pipe=largest["of_pipeline"],
                  hid=largest["hidden_fraction"],
                  noisy=f"; {noisy} median(s) past 1 with a round under it: noise" if noisy else "",
                  out=(" Out of model: " + "; ".join(out) + ".") if out else "",
                  recorded=recorded)]
    for r in results:
        e, k = r.experiment, r.best_chunks()
        best, one = r.spreads(k), r.spreads(1)
        made.append(claim(
            "ffn {ffn:,}, {tokens:,} tokens {where}: the best overlapped step ({k} chunks) runs "
            "{gain:.2fx} as fast as the serial step: {verdict}. No schedule can beat the ceiling "
            "serial / max(compute, comm), {ceiling:.2fx}; one chunk, the serial step's own work, "
            "ran {noise:.2fx}.", not best["efficiency"].above(BOUNDS["efficiency"]),
            ffn=e.ffn, tokens=e.tokens, where=where, k=k, gain=best["speedup"],
            verdict=gain_verdict(best["speedup"]), ceiling=best["ceiling"], noise=one["speedup"],
            recorded=recorded))
    return made


def _message_rate(r: TPResult) -> tuple[float, float, float]:
    """One unchunked all-reduce: bytes, median microseconds and GB/s."""
    e = r.experiment
    nbytes = e.tokens * e.hidden * DTYPES[e.dtype].itemsize
    us = r.spreads(1)["comm_us"].median
    return nbytes, us, nbytes / us / 1e3


def decode_claims(prefill: list[TPResult], decode: list[TPResult], where: str,
                  recorded=None) -> list:
    """Decode-sized steps against a prefill-sized one of the same width: the all-reduce pays
    latency, not bandwidth; chunks multiply messages and weight reads; no overlap gains."""
    decode = sorted(decode, key=lambda r: r.experiment.tokens)
    small = decode[0]
    big = next((r for r in prefill if r.experiment.ffn == small.experiment.ffn), prefill[-1])
    (db, dus, dgbs), (pb, pus, pgbs) = _message_rate(small), _message_rate(big)
    k = max(small.experiment.chunk_counts)
    pk = max(c for c in big.experiment.chunk_counts if c <= k)
    cut = small.spreads(k)["comm_us"].median / dus
    cut_prefill = big.spreads(pk)["comm_us"].median / pus
    reread = small.spreads(k)["compute_us"].median / small.spreads(1)["compute_us"].median
    gains = {r.experiment.tokens: r.spreads(r.best_chunks())["speedup"] for r in decode}
    busy = [s["summary"]["gpu_busy_us"] for s in
            (rank["traces"]["overlapped"] for rank in small.ranks)
            if "gpu_busy_us" in s["summary"]]
    span = [s["summary"]["window_us"] for s in
            (rank["traces"]["overlapped"] for rank in small.ranks)
            if "window_us" in s["summary"]]
    profiled = (f"; the profiler saw the GPU busy {max(busy):,.0f} of the traced "
                f"{small.experiment.trace_chunks}-chunk step's {max(span):,.0f} us"
                if busy and span else "")
    return [
        claim("An all-reduce of {t} tokens ({dkib:,.0f} KiB) takes {dus:.1f} us {where}, "
              "{dgbs:.1f} GB/s; of {T:,} tokens ({pmib:,.0f} MiB) {pus:,.0f} us, {pgbs:,.0f} GB/s, "
              "{ratio:.0f}x the rate (above the {factor:.0f}x asked): a decode-sized message "
              "costs its latency, not its bytes.", pgbs > LATENCY_FACTOR * dgbs,
              t=small.experiment.tokens, dkib=db / 2**10, dus=dus, where=where, dgbs=dgbs,
              T=big.experiment.tokens, pmib=pb / 2**20, pus=pus, pgbs=pgbs, ratio=pgbs / dgbs,
              factor=LATENCY_FACTOR, recorded=recorded),
        claim("Cut into {k} chunks at {t} tokens {where}, the all-reduces cost {cut:.1f}x one "
              "message (at {T:,} tokens, {pk} chunks cost {cut_prefill:.2f}x) and the matmuls "
              "{reread:.1f}x: every chunk reads all of the weights again.",
              cut > cut_prefill and reread > 1.5, k=k, t=small.experiment.tokens, where=where,
              cut=cut, T=big.experiment.tokens, pk=pk, cut_prefill=cut_prefill, reread=reread,
              recorded=recorded),
        claim("At decode sizes {where} overlap cannot help: the best chunk count runs {gains} "
              "as fast as the serial step, no range wholly above 1 (step times are CUDA-event times "
              "of the compute stream{profiled}).",
              not any(g.above(1.0) for g in gains.values()), where=where,
              gains=", ".join(f"{g:.2fx} at {t} tokens" for t, g in gains.items()),
              profiled=profiled, recorded=recorded)]
