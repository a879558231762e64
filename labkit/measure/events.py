"""The profiler's events as a table: one row per complete event (lane, kind, name, start, duration,
nesting depth, correlation id), each GPU activity joined to the launch that started it, and the
few numbers that say whether launch overhead matters."""
from __future__ import annotations

import itertools

import pandas as pd

from labkit.measure.intervals import total, union

GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
CPU_CATEGORIES = {"cpu_op": "cpu_op", "user_annotation": "annotation",
                  "cuda_runtime": "runtime", "cuda_driver": "runtime"}
LAUNCH_NAMES = ("LaunchKernel", "GraphLaunch", "Memcpy", "Memset", "LaunchCooperativeKernel")
EVENT_COLUMNS = ["lane", "kind", "name", "start_us", "dur_us", "depth", "correlation"]



def _window(raw: dict, name: str) -> tuple[float, float]:
    for e in raw.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("name") == name:
            return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
    return float("-inf"), float("inf")


def parse_chrome_trace(raw: dict, window: str | None = None) -> pd.DataFrame:
    """Chrome-trace JSON (as ``export_chrome_trace`` writes it) -> one row per complete event.

    With ``window``, only what happened inside the annotation of that name is kept (GPU work
    launched inside it is kept even when it ends later), and the annotation itself is dropped.
    """
    lo, hi = _window(raw, window) if window else (float("-inf"), float("inf"))
    rows = []
    for e in raw.get("traceEvents", []):
        if e.get("ph") != "X" or (window and e.get("name") == window):
            continue
        if not lo <= float(e.get("ts", lo)) <= hi:
            continue
        cat = e.get("cat", "")
        args = e.get("args", {}) or {}
        if cat in GPU_CATEGORIES:
            kind = GPU_CATEGORIES[cat]
            lane = f"GPU {args.get('device', e.get('pid'))} stream {args.get('stream', e.get('tid'))}"
        elif cat in CPU_CATEGORIES:
            kind = CPU_CATEGORIES[cat]
            lane = f"CPU thread {e.get('tid')}"
        else:
            continue
        corr = args.get("correlation")
        rows.append((lane, kind, e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0)),
                     0, int(corr) if corr is not None else -1))
    df = pd.DataFrame(rows, columns=EVENT_COLUMNS)
    if df.empty:
        return df
    df["start_us"] -= df["start_us"].min()
    df = df.sort_values(["lane", "start_us", "dur_us"], ascending=[True, True, False],
                        ignore_index=True)
    df["depth"] = _nesting_depth(df)
    return df


def _nesting_depth(df: pd.DataFrame) -> list[int]:
    """How deep each CPU event sits inside its enclosing events (aten op inside a module...)."""
    depth = [0] * len(df)
    stacks: dict[str, list[float]] = {}
    for i, (lane, start, dur) in enumerate(zip(df["lane"], df["start_us"], df["dur_us"])):
        if lane.startswith("GPU"):
            continue
        stack = stacks.setdefault(lane, [])
        while stack and stack[-1] <= start:
            stack.pop()
        depth[i] = len(stack)
        stack.append(start + dur)
    return depth


def launch_links(events: pd.DataFrame) -> pd.DataFrame:
    """Each GPU activity joined to the CPU call that launched it (first kernel per launch)."""
    launches = events[(events.kind == "runtime") & (events.correlation >= 0)
                      & events.name.str.contains("|".join(LAUNCH_NAMES))]
    gpu = events[events.lane.str.startswith("GPU") & (events.correlation >= 0)]
    gpu = gpu.sort_values("start_us").drop_duplicates("correlation")
    return launches.merge(gpu, on="correlation", suffixes=("_cpu", "_gpu"))


def summarize(events: pd.DataFrame) -> dict:
    """The numbers that say whether launch overhead matters here."""
    if events.empty:
        return {"events": 0}
    span = float((events.start_us + events.dur_us).max() - events.start_us.min())
    out: dict = {"events": len(events), "window_us": span}
    gpu = events[events.lane.str.startswith("GPU")]
    if len(gpu):
        busy = union(gpu.start_us, gpu.start_us + gpu.dur_us)
        gpu_span = busy[-1][1] - busy[0][0]
        gaps = [b[0] - a[1] for a, b in itertools.pairwise(busy)]
        links = launch_links(events)
        launch_starts = links.start_us_cpu.sort_values()
        out.update({
            "kernel_count": int((gpu.kind == "kernel").sum()),
            "gpu_busy_us": total(busy),
            "gpu_span_us": gpu_span,
            "gpu_busy_fraction": total(busy) / gpu_span if gpu_span else 1.0,
            "idle_gaps": len([g for g in gaps if g > 0.5]),
            "idle_total_us": sum(gaps),
            "largest_gap_us": max(gaps, default=0.0),
            "mean_kernel_us": float(gpu[gpu.kind == "kernel"].dur_us.mean()),
            "launches": len(links),
            "mean_launch_to_start_us": float((links.start_us_gpu - links.start_us_cpu).mean())
            if len(links) else None,
            "launch_api_us": float(links.dur_us_cpu.mean()) if len(links) else None,
            "cpu_us_per_launch": float(launch_starts.diff().dropna().mean())
            if len(links) > 1 else None,
        })
    else:
        top = events[(events.depth == 0) & (events.kind == "cpu_op")].sort_values("start_us")
        ends = top.start_us + top.dur_us
        gaps = (top.start_us.iloc[1:].values - ends.iloc[:-1].values) if len(top) > 1 else []
        out.update({
            "top_level_ops": len(top),
            "mean_op_us": float(top.dur_us.mean()) if len(top) else None,
            "mean_gap_between_ops_us": float(pd.Series(gaps).mean()) if len(gaps) else None,
            "cpu_busy_fraction": float(top.dur_us.sum() / span) if span else None,
        })
    return out


def thin(events: pd.DataFrame, max_events: int) -> tuple[pd.DataFrame, int]:
    """Keep a figure small: GPU activity and launches first, then the longest CPU events."""
    if len(events) <= max_events:
        return events, 0
    linked = events.lane.str.startswith("GPU") | (events.kind == "runtime")
    keep = events[linked].sort_values("start_us").head(max_events)
    room = max_events - len(keep)
    if room > 0:
        keep = pd.concat([keep, events[~linked].nlargest(room, "dur_us")])
    return keep.sort_values(["lane", "start_us"], ignore_index=True), len(events) - len(keep)
