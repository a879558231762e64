"""Both ranks' traced steps on one timeline, and what one rank's trace says about overlap: how
much of its communication ran while it computed (what the hardware allowed) and how many
all-reduces it launched before its last matmul (what the schedule asked for). On a GPU the
communication is NCCL's kernels on their own stream; on a CPU, gloo's worker threads.
"""
from __future__ import annotations

import pandas as pd

from labkit.measure import intervals
from labkit.measure.events import EVENT_COLUMNS
from labkit.measure.profile import Trace


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
