"""Notebook 02's figures: step time per batch with its range over rounds and the GPU's busy time
beside it, and what each bucket costs to capture (time and memory, each on its own axis)."""
from __future__ import annotations

import pandas as pd


def step_figure(table: pd.DataFrame, title: str):
    """``measurements.step_table``: wall time per step, eager and replayed, with the range over
    rounds as error bars; the profiler's GPU busy time, where measured, dashed beside it."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for mode in ("eager", "graph"):
        if f"{mode}_us" not in table:
            continue
        fig.add_scatter(x=table.batch, y=table[f"{mode}_us"], mode="lines+markers",
                        name=f"{mode}: wall time", error_y={
                            "type": "data", "symmetric": False,
                            "array": table[f"{mode}_high"] - table[f"{mode}_us"],
                            "arrayminus": table[f"{mode}_us"] - table[f"{mode}_low"]})
        gpu = f"{mode}_gpu_us"
        if gpu in table and table[gpu].notna().all():
            fig.add_scatter(x=table.batch, y=table[gpu], mode="lines+markers",
                            line={"dash": "dot"}, name=f"{mode}: GPU busy (profiler)")
    fig.update_layout(title=title, xaxis={"type": "log", "title": "batch size (rows)"},
                      yaxis={"title": "us per decode step"})
    return fig


def capture_figure(per_key: pd.DataFrame, title: str):
    """``measurements.per_key_table``: capture time (median, range over rounds) and the growth
    of the shared memory pool, per key, in capture order (largest first)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "capture time per key (median, range over rounds)", "memory pool growth per key"))
    fig.add_bar(x=per_key.key, y=per_key.capture_ms, name="capture ms", row=1, col=1,
                error_y={"type": "data", "symmetric": False,
                             "array": per_key.capture_ms_high - per_key.capture_ms,
                             "arrayminus": per_key.capture_ms - per_key.capture_ms_low})
    fig.add_bar(x=per_key.key, y=per_key.pool_MiB, name="pool MiB", row=1, col=2)
    fig.update_yaxes(title_text="ms to capture", row=1, col=1)
    fig.update_yaxes(title_text="MiB added to the pool", row=1, col=2)
    fig.update_xaxes(title_text="key (batch bucket), in capture order", type="category")
    fig.update_layout(title=title, showlegend=False)
    return fig


def summaries_table(summaries: dict) -> pd.DataFrame:
    """Trace summaries side by side, one column each; counts as integers, times to 0.01."""
    def show(v):
        if v is None or pd.isna(v):
            return ""
        return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"
    return pd.DataFrame(summaries).apply(lambda col: col.map(show))
