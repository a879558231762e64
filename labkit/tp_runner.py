"""Run one function on every rank of a small process group: spawned here, or under torchrun.

    results = run_ranks(fn, *args, world_size=2)     # fn(ctx: RankContext, *args) -> picklable

Collectives need one process per rank. Started plainly (a script, a notebook, a test), this
spawns ``world_size`` processes with ``torch.multiprocessing`` (spawn: a fresh interpreter, so it
works from Jupyter as long as ``fn`` is a module-level function), rendezvous on 127.0.0.1 at a
free port, and returns each rank's result in rank order. Started by ``torchrun``, this process
is already one rank: it joins the group torchrun describes, runs ``fn`` and gathers every rank's
result. Backend ``nccl`` with one GPU per rank (NVLink multicast off), ``gloo`` on the CPU.

:class:`TPResult` gathers what the ranks of a tensor-parallel experiment measured: the slowest
rank's times, each rank's errors, and every rank's trace on one timeline.
"""
from __future__ import annotations

import datetime
import math
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import pandas as pd
import torch
import torch.distributed as dist

from labkit.profile import EVENT_COLUMNS, Trace, _union_intervals
from labkit.tensor_parallel import TPExperiment, overlap_metrics

BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))


def pick_backend(backend: str = "auto", world_size: int = 2) -> str:
    """``auto``: NCCL when there is a GPU for every rank, else gloo on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise RuntimeError(f"backend='nccl' needs one GPU per rank: {world_size} ranks asked for, "
                           f"{gpus} GPU(s) visible. Use backend='gloo' (CPU) or run on a host "
                           f"with {world_size} GPUs.")
    return backend


def _join_group(backend: str, rank: int, local_rank: int, world_size: int,
                timeout_s: float) -> RankContext:
    kwargs = {}
    if backend == "nccl":
        # NVLink multicast stays off (on shared hosts it can take the GPUs out of service):
        # the lab measures NCCL's ordinary ring/tree all-reduce.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        device = torch.device("cpu")
        # Ranks share the machine's cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return RankContext(rank, world_size, backend, device)


def _spawned_rank(rank: int, world_size: int, port: int, backend: str, fn: Callable,
                  args: tuple, results, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        ctx = _join_group(backend, rank, rank, world_size, timeout_s)
        message = (rank, True, fn(ctx, *args))
        dist.destroy_process_group()
    except BaseException:
        message = (rank, False, traceback.format_exc())
    try:  # plain pickle: tensors travel by value, not as shared memory this process would own
        results.put(pickle.dumps(message))
    except Exception:
        results.put(pickle.dumps((rank, False, traceback.format_exc())))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is delivered; skip interpreter teardown, where process-group and profiler
    # threads have been seen to abort at random (and which costs seconds per rank).
    os._exit(0 if message[1] else 1)


def _spawn(fn: Callable, args: tuple, world_size: int, backend: str, timeout_s: float) -> list:
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        results, port = ctx.Queue(), s.getsockname()[1]
    procs = [ctx.Process(target=_spawned_rank, name=f"labkit-rank{r}",
                         args=(r, world_size, port, backend, fn, args, results, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            lost = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            try:  # a rank that has exited flushed its message first: give it a last look
                rank, ok, payload = pickle.loads(results.get(timeout=2.0 if lost else 0.5))
            except queue.Empty:
                if lost:
                    raise RuntimeError(
                        f"rank {lost[0]} of {world_size} exited with code {procs[lost[0]].exitcode}"
                        " before returning a result (-9 is usually the out-of-memory killer)"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise TimeoutError(f"no result from ranks {missing} in {timeout_s:.0f} s: "
                                       "pass a larger timeout_s or use smaller sizes") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0)
            if p.is_alive():  # a rank stuck in a collective its failed peer never joined
                p.terminate()
                p.join(timeout=10)
    return [got[r] for r in range(world_size)]


def _run_here(fn: Callable, args: tuple, world_size: int, backend: str, timeout_s: float) -> list:
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world_size:
        raise RuntimeError(f"torchrun started {launched} ranks but {world_size} were asked for: "
                           f"start it with --nproc-per-node {world_size}")
    ctx = _join_group(backend, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                      world_size, timeout_s)
    try:
        result = fn(ctx, *args)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, result)
    finally:
        dist.destroy_process_group()
    return gathered


def run_ranks(fn: Callable, *args, world_size: int = 2, backend: str = "auto",
              timeout_s: float = 600.0) -> list:
    """``fn(ctx, *args)`` on every rank; every rank's result, in rank order.

    ``fn`` must be a module-level function (spawned processes import it by name) and its
    result picklable (tensors come back by value). A rank that raises fails the whole call
    with that rank's traceback.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if launched_by_torchrun():
        return _run_here(fn, args, world_size,
                         pick_backend(backend, int(os.environ["WORLD_SIZE"])), timeout_s)
    return _spawn(fn, args, world_size, pick_backend(backend, world_size), timeout_s)


# --- what the ranks did, side by side ------------------------------------------------------

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


def _intersection_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return total


def comm_overlap(events: pd.DataFrame) -> dict:
    """One rank's trace: how much of its communication ran while it computed (what the hardware
    allowed), and how many all-reduces were launched before its last matmul (what the schedule
    asked for: 0 serial, chunks - 1 overlapped)."""
    comm = _comm_mask(events)
    busy_comm, busy_compute = (_union_intervals(e.start_us, e.start_us + e.dur_us)
                               for e in (events[comm], events[_compute_mask(events, comm)]))
    comm_us = sum(e - s for s, e in busy_comm)
    top = events[(events.kind == "cpu_op") & (events.depth == 0)]
    last_matmul = top.start_us[top.name.str.startswith(("aten::matmul", "aten::mm"))].max()
    return {"collectives": int(comm.sum()), "comm_us": round(comm_us, 1),
            "compute_us": round(sum(e - s for s, e in busy_compute), 1),
            "comm_hidden_fraction": round(_intersection_us(busy_comm, busy_compute) / comm_us, 3)
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
