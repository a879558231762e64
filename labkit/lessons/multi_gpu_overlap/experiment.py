"""The experiment: a tensor-parallel MLP layer timed serial, overlapped and sequential on every
rank in interleaved rounds, its ranks' traces on one timeline (:class:`TPResult`)."""
from __future__ import annotations

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
from labkit.lessons.multi_gpu_overlap.metrics import (
    BOUNDS,
    out_of_model,
    overlap_metrics,
)
from labkit.measure import bench, intervals
from labkit.measure.events import EVENT_COLUMNS
from labkit.measure.profile import Trace, trace
from labkit.measure.rounds import Spread, interleaved


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


