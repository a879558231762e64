"""Draw an event table (from ``labkit.measure.events``) as a plotly timeline.

One lane per CPU thread and per CUDA stream, bars on a microsecond axis, an arrow from each CPU
launch to the GPU work it started. Nested CPU events get thinner bars so an aten op inside a
module call stays visible. Short events are thinned so a notebook stays small.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit.measure.events import launch_links, thin

COLORS = {"cpu_op": "#4C78A8", "annotation": "#9D755D", "runtime": "#F58518",
          "kernel": "#54A24B", "memcpy": "#E45756", "memset": "#B279A2"}
LABELS = {"cpu_op": "CPU op", "annotation": "annotation", "runtime": "CUDA runtime call",
          "kernel": "GPU kernel", "memcpy": "memcpy", "memset": "memset"}


def _lane_order(lanes) -> list[str]:
    cpu = sorted(lane for lane in lanes if lane.startswith("CPU"))
    gpu = sorted(lane for lane in lanes if lane.startswith("GPU"))
    return cpu + gpu


def timeline_figure(events: pd.DataFrame, title: str = "", max_events: int = 2500,
                    arrows: int = 400) -> go.Figure:
    shown, dropped = thin(events, max_events)
    fig = go.Figure()
    for kind, group in shown.groupby("kind", sort=False):
        fig.add_trace(go.Bar(
            y=group.lane, x=group.dur_us.clip(lower=1e-3), base=group.start_us, orientation="h",
            width=(0.8 * 0.72 ** group.depth).round(3), name=LABELS.get(kind, kind),
            marker=dict(color=COLORS.get(kind, "#888"), line=dict(width=0)),
            customdata=group.name.str.slice(0, 80),
            hovertemplate="%{customdata}<br>start %{base:.1f} us, %{x:.2f} us<extra></extra>",
        ))
    links = launch_links(shown).sort_values("start_us_cpu").head(arrows)
    if len(links):
        xs, ys, sizes = [], [], []
        for row in links.itertuples():
            xs += [row.start_us_cpu, row.start_us_gpu, None]
            ys += [row.lane_cpu, row.lane_gpu, None]
            sizes += [0, 8, 0]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", name="launch -> kernel", hoverinfo="skip",
            line=dict(color="rgba(80,80,80,0.45)", width=1),
            marker=dict(symbol="arrow", angleref="previous", size=sizes,
                        color="rgba(80,80,80,0.8)"),
        ))
    order = _lane_order(shown.lane.unique())
    note = f" ({dropped} short events not drawn)" if dropped else ""
    fig.update_layout(
        title=(title or "timeline") + note, barmode="overlay", height=160 + 70 * len(order),
        xaxis_title="time (us)", bargap=0.1, legend=dict(orientation="h", y=-0.25),
        margin=dict(l=10, r=10, t=50, b=10),
    )
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1])
    return fig
