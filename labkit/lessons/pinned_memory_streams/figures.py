"""The notebook's figures: bandwidth over copy size, which batch arrived, step time by phase."""
from __future__ import annotations

import pandas as pd


def bandwidth_figure(df: pd.DataFrame, title: str):
    """GB/s over copy size: pageable, pinned, and pin_memory() on fresh pages then one copy."""
    import plotly.graph_objects as go

    once_us = (df.pin_fresh_then_copy_us if "pin_fresh_then_copy_us" in df
               else df.pin_first_us + df.pinned_us)
    fig = go.Figure()
    for name, y in (("pageable", df.pageable_gbps), ("pinned", df.pinned_gbps),
                    ("pin_memory() then copy, once", df.bytes / once_us / 1e3)):
        fig.add_scatter(x=df.bytes, y=y, mode="lines+markers", name=name)
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="bytes copied",
                      yaxis_title="GB/s host to device")
    return fig


def reuse_figure(unsafe: dict, safe: dict, title: str):
    """Which batch each copy delivered: the diagonal when the data is intact."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, run in (("one pinned buffer, refilled at once", unsafe),
                      ("PinnedStagingPool (events)", safe)):
        fig.add_scatter(x=list(range(run["n_batches"])), y=run["arrived"], mode="lines+markers",
                        name=f"{name}: {run['corrupt']} corrupt")
    fig.update_layout(title=title, xaxis_title="batch sent", yaxis_title="batch that arrived "
                      "(from its checksum)")
    return fig


def step_figure(df: pd.DataFrame, title: str):
    """Step time serial against overlapped, stacked by where the host spent it, beside the
    step's compute timed alone and (on a GPU) the GPU's busy time per step."""
    import plotly.graph_objects as go

    fig = go.Figure()
    phases = [p for p in ("prepare", "copy", "enqueue", "other", "wait", "drain")
              if f"{p}_ms" in df]
    if phases:
        for p in phases:
            fig.add_bar(x=df["mode"], y=df[f"{p}_ms"], name=f"host: {p}")
        fig.update_layout(barmode="stack")
    else:   # a recording without the phases
        fig.add_bar(x=df["mode"], y=df.step_ms, name="measured step")
    if "gpu_busy_ms" in df and df.gpu_busy_ms.notna().all():
        fig.add_scatter(x=df["mode"], y=df.gpu_busy_ms, mode="markers", name="GPU busy (profiler)",
                        marker={"size": 14, "symbol": "diamond"})
    comp = float(df.compute_ms.iloc[0])
    fig.add_hline(y=comp, line_dash="dot", annotation_text="compute alone")
    fig.update_layout(title=title, yaxis_title="ms per step")
    return fig
