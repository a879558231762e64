"""Notebook 06's and appendix 06a's figures, drawn from ``compare.attention_io`` and from a
``benchmarks/attention.py`` result (live, or recorded on a GPU): what tiling moves and holds,
the speeds of each benchmark section as bars with their targets, the block-size sweep, the
registry's time split into host and GPU, and the compiled decode loop's instructions by kind.
A benchmark section that failed or is absent draws a figure saying so. Figures are plotly.
"""
from __future__ import annotations

import functools

import pandas as pd
import plotly.graph_objects as go

from labkit.lessons.attention_backends.compare import attention_io
from labkit.lessons.attention_backends.roofline import (DECODE, LONG_CONTEXT, PREFILL, TARGETS,
                                                       TILE_BEFORE)
from labkit.lessons.attention_backends.sass import group_opcodes


def tiling_figure(lengths, num_heads: int, head_dim: int, block_m: int) -> go.Figure:
    """Two panels over sequence length, from ``attention_io``: the HBM bytes one call moves
    (scores through HBM, tiled, tiled with the causal tiles skipped) and what must sit in HBM
    during the call (naive with its score matrix, tiled with Q, K, V, O only)."""
    from plotly.subplots import make_subplots
    io = pd.DataFrame([attention_io(n, n, num_heads, head_dim, block_m) | {"length": n}
                       for n in lengths])
    fig = make_subplots(rows=1, cols=2, subplot_titles=("HBM bytes moved per call",
                                                        "HBM held during the call"))
    for col, name in (("naive_bytes", "naive: S and P written and read back"),
                      ("tiled_bytes", f"tiled: K/V re-read once per {block_m}-query tile"),
                      ("causal_tiled_bytes", "tiled, causal: tiles above the diagonal skipped")):
        fig.add_scatter(x=io.length, y=io[col] / 2**20, mode="lines+markers", name=name,
                        row=1, col=1)
    for col, name in (("naive_memory_bytes", "naive: Q, K, V, O + the [S, S] scores"),
                      ("tiled_memory_bytes", "tiled: Q, K, V, O only")):
        fig.add_scatter(x=io.length, y=io[col] / 2**20, mode="lines+markers", name=name,
                        line_dash="dot", row=1, col=2)
    fig.update_xaxes(title_text="sequence length", type="log")
    fig.update_yaxes(title_text="MiB", type="log")
    fig.update_layout(title=f"Attention in HBM, {num_heads} heads, head_dim {head_dim}",
                      height=460, legend={"orientation": "h", "y": -0.25})
    return fig


def _bars(rows: dict[str, float], title: str, unit: str, lines: dict[str, float]) -> go.Figure:
    fig = go.Figure(go.Bar(x=list(rows), y=list(rows.values()), text=[f"{v:,.0f}" for v in
                                                                       rows.values()]))
    for name, y in lines.items():
        fig.add_hline(y=y, line_dash="dash", annotation_text=name)
    fig.update_layout(title=title, yaxis_title=unit, height=420)
    return fig


def _needs(section: str):
    """A benchmark section that failed or is absent draws a figure saying so, not a traceback."""
    def wrap(figure):
        @functools.wraps(figure)
        def draw(data: dict, *args, **kwargs):
            value = data.get(section)
            if not value or (isinstance(value, dict) and "error" in value):
                why = value["error"] if isinstance(value, dict) else "no data"
                fig = go.Figure()
                fig.add_annotation(text=f"{section} not measured: {why}"[:200], showarrow=False)
                return fig.update_layout(title=f"{section}: not measured", height=200)
            return figure(data, *args, **kwargs)
        return draw
    return wrap


@_needs("prefill")
def prefill_figure(data: dict, matmul_tflops: float | None, subtitle: str = "") -> go.Figure:
    rows = {k: v["tflops"] for k, v in data["prefill"].items()
            if isinstance(v, dict) and "tflops" in v}
    p = PREFILL
    return _bars(rows, f"causal prefill B{p['batch']} H{p['heads']} S{p['seq']} "
                 f"D{p['head_dim']} bf16{subtitle}", "TFLOP/s",
                 {"matmul rate": matmul_tflops} if matmul_tflops else {})


@_needs("decode")
def decode_figure(data: dict, subtitle: str = "") -> go.Figure:
    d, copy = data["decode"], data["copy_gbps"]
    rows = {k: v["gbps"] for k, v in d.items() if isinstance(v, dict) and "gbps" in v}
    need = TARGETS["decode: ours, fraction of copy bandwidth"]
    return _bars(rows, f"paged decode B{DECODE['batch']} GQA {DECODE['q_heads']}/"
                 f"{DECODE['kv_heads']} ctx {DECODE['context']} block {DECODE['block_size']}"
                 f"{subtitle}", "KV GB/s",
                 {"copy bandwidth": copy, f"target: {need:.0%} of copy": need * copy})


@_needs("long_context")
def long_context_figure(data: dict, subtitle: str = "") -> go.Figure:
    lc, copy = data["long_context"], data["copy_gbps"]
    fig = go.Figure()
    for mode in ("split (auto)", TILE_BEFORE, "no split"):
        keys = [k for k in lc if k.endswith(mode) and "gbps" in lc[k]]
        if keys:  # recordings made before the 32-key tile have no 64-key bars
            fig.add_bar(x=[k.split()[0] for k in keys], y=[lc[k]["gbps"] for k in keys],
                        name=mode)
    needs = {}  # target -> the batches it is set for
    for b in (1, 2, 4):
        needs.setdefault(TARGETS[f"long context B{b}, split: fraction of copy bandwidth"],
                         []).append(f"B{b}")
    for need, batches in needs.items():
        fig.add_hline(y=need * copy, line_dash="dash",
                      annotation_text=f"target {', '.join(batches)}: {need:.0%} of copy bandwidth")
    fig.update_layout(title=f"decode at {LONG_CONTEXT:,} tokens: split-KV vs one program per "
                      f"KV head{subtitle}", xaxis_title="batch", yaxis_title="KV GB/s",
                      height=420)
    return fig


@_needs("fp8")
def fp8_figure(data: dict, subtitle: str = "") -> go.Figure:
    f = data["fp8"]
    rows = {k: v["tokens_per_s"] for k, v in f.items() if isinstance(v, dict) and
            "tokens_per_s" in v}
    need = TARGETS["fp8 cache vs bf16 decode (speed ratio)"]
    bf16 = (f.get("bf16") or {}).get("tokens_per_s")
    return _bars(rows, f"decode throughput, bf16 vs fp8 (e4m3) KV cache{subtitle}",
                 "tokens/s", {f"target: {need} x bf16": need * bf16} if bf16 else {})


@_needs("block_sweep")
def block_sweep_figure(data: dict, subtitle: str = "") -> go.Figure:
    sweep = pd.DataFrame(data["block_sweep"])
    fig = go.Figure()
    for ctx, g in sweep.groupby("context"):
        fig.add_scatter(x=g.block_size, y=g.gbps, mode="lines+markers", name=f"context {ctx}")
    fig.add_hline(y=data["copy_gbps"], line_dash="dash", annotation_text="copy bandwidth")
    fig.update_layout(title=f"paged decode GB/s over block size, batch "
                      f"{sweep.batch.iloc[0]}{subtitle}", xaxis_title="block size (tokens)",
                      xaxis={"type": "log", "tickvals": sorted(sweep.block_size.unique())},
                      yaxis_title="KV GB/s", height=420)
    return fig


def registry_split_figure(split: pd.DataFrame, subtitle: str = "") -> go.Figure:
    """``claims_registry.registry_split`` as grouped bars per (workload, backend): the registry's
    wall time, the GPU's kernel time inside it, and the bare kernel the benchmark timed."""
    names = [f"{r.workload}<br>{r.backend}" for r in split.itertuples()]
    fig = go.Figure()
    for col, label in (("wall_us", "registry call: wall time"),
                       ("gpu_us", "registry call: GPU kernel time (profiler)"),
                       ("bare_us", "bare kernel (benchmark)")):
        fig.add_bar(x=names, y=split[col], name=label)
    fig.update_layout(title=f"one call through the registry against the bare kernel{subtitle}",
                      yaxis_title="us (log)", yaxis_type="log", barmode="group", height=460)
    return fig


def sass_figure(loops: dict[str, dict]) -> go.Figure:
    """The compiled decode loop's instructions per key (all warps), by kind, per cache dtype:
    ``sass.decode_loops`` counted through ``sass.group_opcodes``."""
    fig = go.Figure()
    for cache, d in loops.items():
        per_key = d["num_warps"] / d["block_n"]  # a warp's instructions, over the keys it serves
        groups = group_opcodes(d["opcodes"])
        fig.add_bar(x=list(groups), y=[n * per_key for n in groups.values()], name=cache)
    arch = next(iter(loops.values()))["arch"]
    fig.update_layout(title=f"paged decode loop compiled for {arch}: instructions per key, by "
                      "kind", yaxis_title="instructions per key (all warps)", barmode="group",
                      height=440)
    return fig
