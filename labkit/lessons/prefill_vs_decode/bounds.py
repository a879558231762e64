"""What bounds a measured step, read from ``forward.time_forwards``'s points and the profiler's
summaries: what a graph replay saves (``graph_gain``), what fusing the small layer ops saves
(``fused_gain``), whether an eager step is the host's or the GPU's (``overhead_table``), how
near a replayed decode gets to its bandwidth floor, and the kernels a step runs
(``kernel_table``). Counts (kernels, launches, rows) are built as integers."""
from __future__ import annotations

import pandas as pd


def eager_ms(points: pd.DataFrame, shape: str) -> float:
    """The eager (unfused) time of the point named ``shape``."""
    plain = points[~points.fused.astype(bool)] if "fused" in points else points
    return float(plain[(plain["shape"] == shape) & (plain["mode"] == "eager")].ms.iloc[0])


def graph_gain(points: pd.DataFrame) -> pd.DataFrame:
    """Per shape: eager and graph-replay ms and the replay's speed-up."""
    wide = points.pivot_table(index=["shape", "kind"], columns="mode", values="ms", sort=False)
    return wide.assign(speedup=wide["eager"] / wide["graph"]).reset_index()


def fused_gain(points: pd.DataFrame, fused: pd.DataFrame, copy_gbps: float) -> pd.DataFrame:
    """Per shape and mode measured both ways: ms with the small ops as separate kernels and as
    fused ones (``LlamaModel.fused_ops``), the speed-up, and each one's share of the copy
    bandwidth (the step's bytes over its time)."""
    keys = ["shape", "kind", "mode"]
    both = points.merge(fused, on=keys, suffixes=("", "_fused"))
    return pd.DataFrame({
        **{k: both[k] for k in keys}, "ms": both.ms, "ms_fused": both.ms_fused,
        "speedup": both.ms / both.ms_fused, "share_of_copy": both.gbps / copy_gbps,
        "share_of_copy_fused": both.gbps_fused / copy_gbps})


def overhead_table(points: pd.DataFrame) -> pd.DataFrame:
    """Per eager point, what bounds it. ``points`` carries ``floor_ms`` (the op-issue floor
    timed in the same rounds, see ``time_forwards``).

    On a GPU launches are asynchronous: the host issues op i+1 while the GPU runs op i, so an
    eager step takes about ``max(issue floor, GPU time)``, not their sum. A graph replay pays no
    host issue, so its time is the GPU time. ``model_ms`` is that max, ``bound`` names the
    larger term and ``model_error`` is eager / model - 1. Without a replay (a CPU, where the
    same thread issues each op and then computes it) the two add up: ``floor_share`` is the
    floor over the eager step, and a share above 1 means the floor did not measure issue cost
    alone (it is kept, not clipped: ``floor_over_step`` marks it)."""
    eager = points[points["mode"] == "eager"].reset_index(drop=True)
    if "fused" in eager:
        eager = eager[~eager.fused.astype(bool)].reset_index(drop=True)
    out = eager[["shape", "kind", "flops_per_byte", "ms", "floor_ms"]].rename(
        columns={"floor_ms": "issue_floor_ms"})
    out["floor_share"] = out.issue_floor_ms / out.ms
    out["floor_over_step"] = out.floor_share > 1
    if "graph" in set(points["mode"]):
        graph = points[points["mode"] == "graph"]
        if "fused" in graph:
            graph = graph[~graph.fused.astype(bool)]
        gpu = out["shape"].map(graph.set_index("shape").ms)
        out["gpu_ms"] = gpu
        out["model_ms"] = pd.concat([out.issue_floor_ms, gpu], axis=1).max(axis=1)
        out["bound"] = ["host" if f >= g else "GPU" for f, g in zip(out.issue_floor_ms, gpu)]
        out["model_error"] = out.ms / out.model_ms - 1
    return out


def bandwidth_floor(points: pd.DataFrame, copy_gbps: float) -> pd.DataFrame:
    """Each decode step replayed from a graph beside the time its bytes take at ``copy_gbps``
    (its floor if it did nothing but stream them) and the share of that bandwidth it reached."""
    if "fused" in points:
        points = points[~points.fused.astype(bool)]
    dec = points[(points.kind == "decode") & (points["mode"] == "graph")]
    return pd.DataFrame({"shape": dec["shape"], "batch": dec.batch.astype(int), "ms": dec.ms,
                         "bandwidth floor (ms)": dec["bytes"] / (copy_gbps * 1e6),
                         "share of copy bandwidth": dec.gbps / copy_gbps}).reset_index(drop=True)


def replayed_prefill(points: pd.DataFrame, min_tokens: int) -> tuple[str, float] | None:
    """(name, ms) of the shortest prefill of at least ``min_tokens`` tokens replayed from a
    graph: its GPU time bounds from above the GPU work of a chunk that size. None without one."""
    if "fused" in points:
        points = points[~points.fused.astype(bool)]
    big = points[(points["mode"] == "graph") & (points.kind == "prefill")
                 & (points.tokens >= min_tokens)]
    if not len(big):
        return None
    row = big.sort_values("tokens").iloc[0]
    return row["shape"], float(row.ms)


COUNTS = ("kernel_count", "launches", "top_level_ops")
SHOWN = {"kernel_count": "kernels", "launches": "launches", "mean_kernel_us": "mean kernel (us)",
         "gpu_busy_fraction": "GPU busy", "top_level_ops": "op calls",
         "mean_op_us": "mean op (us)", "cpu_busy_fraction": "CPU busy"}


def kernel_table(profiles: dict[str, dict]) -> pd.DataFrame:
    """One row per profiled step (``Trace.summary``, named): on a GPU its kernels and launches,
    a kernel's mean GPU time and how busy the GPU was; on a CPU its top-level op calls. A count
    is an integer column (nullable where a row has none), never a float such as 688.0."""
    rows = {name: {k: s[k] for k in SHOWN if k in s} for name, s in profiles.items()}
    table = pd.DataFrame.from_dict(rows, orient="index")
    for col in (c for c in COUNTS if c in table):
        table[col] = table[col].astype("Int64")
    return table[[c for c in SHOWN if c in table]].rename(columns=SHOWN)
