"""Notebook 09: a tensor-parallel MLP's all-reduce, serial against overlapped with the next
chunk's compute, measured on every rank and read off both ranks' timelines.

:class:`TPExperiment` is one layer size timed for several chunk counts; :func:`run_experiment`
runs it on every rank (:func:`labkit.distributed.run_ranks`); :class:`TPResult` gathers what the
ranks measured: the slowest rank's times, each rank's errors, and every rank's trace on one
timeline. :func:`overlap_metrics` says how well a step hid its communication.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd
import torch
import torch.distributed as dist

from labkit import check_positive_int
from labkit.distributed.rank_runner import pick_backend, run_ranks
from labkit.distributed.tensor_parallel import (DTYPES, TensorParallelMLP, TPConfig, full_weights,
                                                make_input, mlp_reference, token_chunks)
from labkit.measure import bench
from labkit.measure import intervals
from labkit.measure.events import EVENT_COLUMNS
from labkit.measure.profile import Trace, trace


def overlap_metrics(serial_us: float, overlapped_us: float, compute_us: float,
                    comm_us: float, num_chunks: int = 1) -> dict:
    """How well the overlapped step hides communication.

    ``efficiency = max(compute, comm) / overlapped``: 1.0 when the step takes only as long as
    the longer of the two (the shorter one entirely hidden); ``speedup = serial / overlapped``;
    ``hidden_fraction``: how much of the shorter one disappeared from the step.

    A pipeline of ``num_chunks`` equal chunks cannot reach ``max(compute, comm)``: the first
    chunk's compute runs before any all-reduce can start, the last chunk's all-reduce after all
    compute. ``pipeline_us = max + min / num_chunks`` is that bound (one chunk: the serial sum),
    and ``of_pipeline = pipeline_us / overlapped`` how close the step came to it.
    """
    times = dict(serial_us=serial_us, overlapped_us=overlapped_us, compute_us=compute_us,
                 comm_us=comm_us)
    bad = {k: v for k, v in times.items() if not v > 0}
    if bad:
        raise ValueError(f"times must be positive microseconds, got {bad}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    ideal, shorter = max(compute_us, comm_us), min(compute_us, comm_us)
    pipeline = ideal + shorter / num_chunks
    return {**times, "ideal_us": ideal, "pipeline_us": pipeline,
            "efficiency": ideal / overlapped_us, "of_pipeline": pipeline / overlapped_us,
            "speedup": serial_us / overlapped_us,
            "hidden_fraction": (compute_us + comm_us - overlapped_us) / shorter}


@dataclass(frozen=True)
class TPExperiment:
    """One layer size, timed serial and overlapped for each chunk count, and traced once."""
    tokens: int
    hidden: int
    ffn: int
    dtype: str = "float32"
    chunk_counts: tuple[int, ...] = (1, 2, 4, 8)
    trace_chunks: int = 4
    warmup: int = 2
    repeats: int = 10
    seed: int = 0

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

    def layer_config(self, world_size: int) -> TPConfig:
        return TPConfig(self.hidden, self.ffn, world_size, self.seed)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def experiment_rank(ctx, exp: TPExperiment) -> dict:
    """On one rank (inside ``run_ranks``): outputs against the single-device reference, each
    schedule timed (median after warm-up), then one serial and one overlapped step traced."""
    cfg, dtype = exp.layer_config(ctx.world_size), DTYPES[exp.dtype]
    w1, w2 = full_weights(cfg)
    layer = TensorParallelMLP(cfg, ctx.rank, device=ctx.device, dtype=dtype, weights=(w1, w2))
    x = make_input(exp.tokens, exp.hidden, exp.seed + 1, dtype, ctx.device)
    # The reference sees the same rounded weights: what is left is the layer's own rounding.
    ref = mlp_reference(x.float(), *(w.to(ctx.device, dtype).float() for w in (w1, w2)))
    errors = {"serial": _relative_error(layer.forward_serial(x), ref)}
    for k in exp.chunk_counts:
        errors[f"overlapped, {k} chunks"] = _relative_error(layer.forward_overlapped(x, k), ref)
    del w1, w2, ref
    zeros = torch.zeros_like(x)

    def timed(fn) -> float:
        dist.barrier()  # both ranks start each measurement together
        return bench.measure(fn, device=ctx.device, warmup=exp.warmup,
                             repeats=exp.repeats).median_us

    serial_us = timed(lambda: layer.forward_serial(x))
    rows = [{"num_chunks": k, "serial_us": serial_us,
             "overlapped_us": timed(lambda: layer.forward_overlapped(x, k)),
             "compute_us": timed(lambda: layer.forward_overlapped(x, k, communicate=False)),
             "comm_us": timed(lambda: layer.communicate_only(zeros, k))}
            for k in exp.chunk_counts]
    traces = {}
    for mode, fn in (("serial", lambda: layer.forward_serial(x)),
                     ("overlapped", lambda: layer.forward_overlapped(x, exp.trace_chunks))):
        dist.barrier()
        traces[mode] = trace(fn, device=ctx.device, warmup=1).to_dict()
    return {"rank": ctx.rank, "device": str(ctx.device), "rows": rows, "errors": errors,
            "traces": traces}


def run_experiment(exp: TPExperiment, world_size: int = 2, backend: str = "auto",
                   timeout_s: float = 600.0) -> TPResult:
    """Spawn ``world_size`` ranks (or join torchrun's) and run :func:`experiment_rank` on each."""
    exp.layer_config(world_size)  # a bad size fails here, not in every child
    backend = pick_backend(backend, world_size)
    ranks = run_ranks(experiment_rank, exp, world_size=world_size, backend=backend,
                      timeout_s=timeout_s)
    return TPResult(exp, backend, ranks)


# Compute grows with ffn, the all-reduce ([tokens, hidden]) does not: one of these sizes puts the
# two close together on 2 GPUs over NVLink, 28672 is a Llama-70B-sized MLP.
GPU_SHAPES = dict(tokens=8192, hidden=8192, dtype="bfloat16", chunk_counts=(1, 2, 4, 8, 16),
                  trace_chunks=4, warmup=5, repeats=30)
GPU_FFN_SIZES = (2048, 8192, 28672)


def record() -> dict:
    """`make record` on a host with 2 GPUs: the sweep and the traces for each ffn size."""
    from labkit.tools.recorded import NeedsMoreGPUs

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise NeedsMoreGPUs(f"multi_gpu_overlap needs 2 GPUs (one rank per GPU, NCCL); this machine "
                            f"has {gpus}. Run `python -m labkit.tools.record multi_gpu_overlap` on a 2-GPU host.")
    runs = [run_experiment(TPExperiment(ffn=ffn, **GPU_SHAPES), world_size=2, backend="nccl")
            for ffn in GPU_FFN_SIZES]
    return {"runs": [r.to_dict() for r in runs],
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)]}


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


@dataclass
class TPResult:
    """Every rank's measurements of one experiment. A step ends when its slowest rank ends, so
    the ``table`` takes each time from the slowest rank."""
    experiment: TPExperiment
    backend: str
    ranks: list[dict]

    @property
    def table(self) -> pd.DataFrame:
        per_rank = pd.DataFrame([row for r in self.ranks for row in r["rows"]])
        slowest = per_rank.groupby("num_chunks", as_index=False).max()
        rows = [{"num_chunks": int(r.num_chunks),
                 **overlap_metrics(r.serial_us, r.overlapped_us, r.compute_us, r.comm_us,
                                   int(r.num_chunks))}
                for r in slowest.itertuples()]
        return pd.DataFrame(rows)

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
    def from_dict(cls, d: dict) -> "TPResult":
        exp = dict(d["experiment"], chunk_counts=tuple(d["experiment"]["chunk_counts"]))
        return cls(TPExperiment(**exp), d["backend"], d["ranks"])

    def figure(self, title: str):
        """Step time per chunk count; dotted: the best overlap can do (max of the two), dashed:
        the best a pipeline of that many chunks can do."""
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


def sweep_summary(results: list[TPResult]) -> pd.DataFrame:
    """One row per experiment: its best chunk count and what that step achieved, and how much
    longer the NCCL (or gloo) work ran in the traced overlapped step than in the serial one
    (``comm_stretch``: communication that shares the GPU with matmuls runs slower)."""
    rows = []
    for r in results:
        table, e = r.table, r.experiment
        best = table.loc[table.speedup.idxmax()]
        one = table.loc[table.num_chunks.idxmin()]
        serial, overlapped = (r.trace(m).summary for m in ("serial", "overlapped"))
        stretch = [overlapped[k]["comm_us"] / serial[k]["comm_us"] for k in serial
                   if serial[k]["comm_us"] > 0]
        rows.append({"ffn": e.ffn, "compute_over_comm": one.compute_us / one.comm_us,
                     "serial_us": one.serial_us, "best_chunks": int(best.num_chunks),
                     "best_overlapped_us": best.overlapped_us, "speedup": best.speedup,
                     "efficiency": best.efficiency, "of_pipeline": best.of_pipeline,
                     "comm_stretch": sum(stretch) / len(stretch) if stretch else float("nan")})
    return pd.DataFrame(rows)
