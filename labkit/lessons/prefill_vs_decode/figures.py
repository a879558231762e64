"""Notebook 07's figures of the forward: measured points on the roofline, decode's intensity
against the batch beside the ridge, one bar per shape, and an eager step's time beside the two
terms that bound it."""
from __future__ import annotations

from typing import Sequence

import pandas as pd
import plotly.graph_objects as go

from labkit.engine.config import ModelConfig
from labkit.lessons.prefill_vs_decode.cost import decode_intensity, knee_batch


def roofline_figure(points: pd.DataFrame, copy_gbps: float, matmul_tflops: float,
                    title: str) -> go.Figure:
    """Notebook 06's roofline, one series per (kind, mode), each point labelled S= or B=."""
    from labkit.lessons.attention_backends.roofline import roofline_figure as roofline

    pts = points.assign(workload=points.kind, backend=points.kind + " (" + points["mode"] + ")")
    fig = roofline(pts, copy_gbps, matmul_tflops, title).update_layout(
        xaxis_title="arithmetic intensity (FLOPs per byte moved)")
    for trace in fig.data:
        g = pts[pts.backend == trace.name]
        if len(g):
            trace.update(mode="markers+text+lines", textposition="top center",
                         text=[f"S={t}" if k == "prefill" else f"B={b}"
                               for k, t, b in zip(g.kind, g.tokens, g.batch)],
                         hovertext=g["shape"], hovertemplate="%{hovertext}: %{x:.1f} FLOP/B, "
                                                             "%{y:.3g} TFLOP/s")
    return fig


def knee_figure(config: ModelConfig, contexts: Sequence[int], ridge: float,
                batches: Sequence[int], title: str) -> go.Figure:
    """Decode's FLOPs per byte over the batch, one line per context, against the ridge."""
    fig = go.Figure()
    for ctx in contexts:
        knee = knee_batch(config, ctx, ridge)
        fig.add_scatter(x=list(batches), y=[decode_intensity(config, b, ctx) for b in batches],
                        mode="lines", name=f"{f'context {ctx}' if ctx else 'weights only'}: "
                                           f"knee {'never' if knee is None else f'B={knee}'}")
    fig.add_scatter(x=[batches[0], batches[-1]], y=[ridge] * 2, mode="lines", line_dash="dash",
                    line_color="gray", name=f"ridge: {ridge:,.0f} FLOP/B")
    return fig.update_layout(title=title, xaxis_title="decode batch (sequences)", height=420,
                             yaxis_title="FLOPs per byte", xaxis_type="log", yaxis_type="log")


def bars_figure(df: pd.DataFrame, y: pd.Series, text: list[str], title: str, yaxis: str
                ) -> go.Figure:
    """One bar per shape, coloured by kind (the graph gain, the op-issue share)."""
    colors = df.kind.map({"prefill": "#1f77b4", "decode": "#d62728"})
    fig = go.Figure(go.Bar(x=df["shape"], y=y, text=text, marker_color=colors))
    return fig.update_layout(title=title, yaxis_title=yaxis, height=420)


def bound_figure(overhead: pd.DataFrame, title: str) -> go.Figure:
    """Per eager shape (``bounds.overhead_table`` with GPU time): the eager step, its host issue
    floor and its GPU time (the replay), on a log axis: the eager bar sits at the taller of the
    other two."""
    fig = go.Figure()
    for col, name, color in (("ms", "eager step", "black"),
                             ("issue_floor_ms", "host issue floor", "#ff7f0e"),
                             ("gpu_ms", "GPU time (replay)", "#2ca02c")):
        fig.add_bar(x=overhead["shape"], y=overhead[col], name=name, marker_color=color)
    return fig.update_layout(title=title, barmode="group", height=420, yaxis_type="log",
                             yaxis_title="ms (log)")
