"""Chunked prefill's one knob, the token budget, swept: the running requests' worst gap
against the long prompt's TTFT.

A step holds at most ``max_num_batched_tokens`` tokens, so the budget sets the chunk. A small
one keeps every step short (the running requests barely notice the prompt) but cuts the prompt
into many steps, each paying a step's fixed costs (reading every weight, the host's launches)
before the prompt's first token. A large one does the reverse. ``budget_sweep`` runs notebook
07's scenario once per budget and once with the whole prompt in one step, every engine in the
same shuffled rounds, mixed steps replayed piecewise; ``budget_claims`` says which budgets meet
both marks the engine is held to: the worst gap cut ``GAP_TARGET`` times, the TTFT within
``TTFT_TARGET`` of one step's.
"""
from __future__ import annotations

import inspect
import math
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit import check_positive_int
from labkit.engine import LLM
from labkit.lessons.prefill_vs_decode.chunked_claims import (GAP_TARGET, TTFT_TARGET,
                                                             per_round_ratio)
from labkit.lessons.prefill_vs_decode.chunked_prefill import Interference, interleaved_runs
from labkit.lessons.prefill_vs_decode.where import on as _on
from labkit.measure.rounds import Spread
from labkit.teaching import claim


# LLM's default max_num_batched_tokens: the budget the engine runs with unless told otherwise
ENGINE_BUDGET = inspect.signature(LLM).parameters["max_num_batched_tokens"].default


def budget_sweep(model, *, budgets: Sequence[int], cudagraph_mode: str | None = None,
                 num_running: int = 16, running_tokens: int = 64, long_prompt: int = 16000,
                 arrive_after: int = 8, kv_cache_memory: int | None = None, rounds: int = 3,
                 seed: int = 0) -> list[Interference]:
    """One chunked run per budget of ``budgets`` (ascending), then the whole prompt in one
    step, each on its own engine in ``cudagraph_mode`` (None: the device's default), all in the
    same ``rounds`` shuffled rounds (``chunked_prefill.interleaved_runs``)."""
    budgets = sorted({check_positive_int("budget", b, hint="tokens per step") for b in budgets})
    if not budgets:
        raise ValueError("budgets must name at least one token budget")
    if budgets[0] <= num_running:
        raise ValueError(f"budget {budgets[0]} leaves no room for a chunk beside the "
                         f"{num_running} decodes: each budget must exceed num_running")
    if budgets[-1] >= long_prompt + num_running:
        raise ValueError(f"budget {budgets[-1]} holds the whole prompt ({long_prompt} tokens) "
                         "and the decodes: that is the unchunked run; sweep smaller budgets")
    configs = [(True, b, cudagraph_mode) for b in budgets]
    configs.append((False, long_prompt + num_running, cudagraph_mode))
    return interleaved_runs(model, configs, num_running=num_running,
                            running_tokens=running_tokens, long_prompt=long_prompt,
                            arrive_after=arrive_after, kv_cache_memory=kv_cache_memory,
                            rounds=rounds, seed=seed)


def _split(runs: Sequence[Interference]) -> tuple[list[Interference], Interference]:
    chunked = sorted((r for r in runs if r.chunked), key=lambda r: r.budget)
    whole = [r for r in runs if not r.chunked]
    if len(whole) != 1 or not chunked:
        raise ValueError("runs must hold one unchunked run and at least one chunked run "
                         "(budget_sweep's output)")
    return chunked, whole[0]


def trade(runs: Sequence[Interference]) -> pd.DataFrame:
    """One row per budget: the worst gap and the TTFT (median over the rounds, with the
    range), and against the whole prompt in one step, round by round: how many times shorter
    the worst gap is (``gap_cut``) and how many times longer the TTFT (``ttft_cost``)."""
    chunked, whole = _split(runs)
    rows = []
    for r in chunked:
        gap, ttft = Spread.of(r.per_round("worst_gap_ms")), Spread.of(r.per_round("long_ttft_ms"))
        cut = per_round_ratio(whole, "worst_gap_ms", r, "worst_gap_ms")
        cost = per_round_ratio(r, "long_ttft_ms", whole, "long_ttft_ms")
        rows.append({"token budget": r.budget, "steps": len(r.steps),
                     "mixed steps": int(r.mixed.sum()), "worst gap (ms)": gap.median,
                     "worst gap range": f"{gap.low:.1f}-{gap.high:.1f}",
                     "TTFT (ms)": ttft.median, "TTFT range": f"{ttft.low:.1f}-{ttft.high:.1f}",
                     "gap_cut": cut.median, "gap_cut_low": cut.low,
                     "ttft_cost": cost.median, "ttft_cost_high": cost.high,
                     "meets both": bool(cut.above(GAP_TARGET) and cost.below(TTFT_TARGET))})
    return pd.DataFrame(rows)


def figure(runs: Sequence[Interference], title: str) -> go.Figure:
    """Worst gap and TTFT per budget (bars, with the rounds' range), the whole prompt in one
    step as a dashed line on each."""
    chunked, whole = _split(runs)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "running requests' worst gap (ms)", "long prompt's TTFT (ms)"))
    labels = [f"{r.budget:,}" for r in chunked]
    for col, name in ((1, "worst_gap_ms"), (2, "long_ttft_ms")):
        spreads = [Spread.of(r.per_round(name)) for r in chunked]
        fig.add_bar(x=labels, y=[s.median for s in spreads], row=1, col=col, showlegend=False,
                    text=[f"{s.median:.1f}" for s in spreads], marker_color="#1f77b4",
                    error_y=dict(type="data", symmetric=False,
                                 array=[s.high - s.median for s in spreads],
                                 arrayminus=[s.median - s.low for s in spreads]))
        one = Spread.of(whole.per_round(name)).median
        fig.add_hline(y=one, line_dash="dash", row=1, col=col,
                      annotation_text=f"whole prompt in one step: {one:.1f}")
    fig.update_xaxes(title_text="token budget (max_num_batched_tokens)", type="category")
    fig.update_layout(title=title, height=420)
    return fig


def budget_claims(runs: Sequence[Interference], *, chosen: int | None = None,
                  device: str | None = None, recorded=None) -> list:
    """The trade (a larger budget: a longer worst gap and a shorter TTFT, medians in budget
    order), and which budgets meet both marks in every round, ``chosen`` (default: the
    engine's default budget, ``ENGINE_BUDGET``) among them."""
    chosen = ENGINE_BUDGET if chosen is None else chosen
    whole = _split(runs)[1]
    t, where = trade(runs), _on(recorded, device)
    gaps, ttfts = list(t["worst gap (ms)"]), list(t["TTFT (ms)"])
    rising = all(a < b for a, b in zip(gaps, gaps[1:]))
    falling = all(a > b for a, b in zip(ttfts, ttfts[1:]))
    meeting = [int(b) for b, ok in zip(t["token budget"], t["meets both"]) if ok]
    row = t[t["token budget"] == chosen]
    at = row.iloc[0].to_dict() if len(row) else {}  # the chosen budget's row, if measured
    listed = ", ".join(f"{b:,}" for b in t["token budget"])
    return [
        claim("From a budget of {lo:,} to {hi:,} tokens{where}, the running requests' worst gap "
              "grows from {g0:.1f} to {g1:.1f} ms while the long prompt's TTFT falls from "
              "{t0:.1f} to {t1:.1f} ms (medians of {n} rounds): each larger chunk stalls the "
              "decodes longer and leaves the prompt fewer steps to wait through.",
              rising and falling and len(gaps) >= 2, lo=int(t["token budget"].iloc[0]),
              hi=int(t["token budget"].iloc[-1]), where=where, g0=gaps[0], g1=gaps[-1],
              t0=ttfts[0], t1=ttfts[-1], n=len(whole.per_round("long_ttft_ms")),
              recorded=recorded),
        claim("Against the whole prompt in one step, the worst gap must be cut at least "
              "{gap:g}x and the TTFT stay within {ttft:g}x, in every round. Of the budgets "
              "tried ({listed} tokens), these meet both{where}: {meeting}. The engine's default, "
              "max_num_batched_tokens={chosen}, is among them "
              "(gap cut {cut:.1f}x, lowest round {cut_lo:.1f}x; TTFT {cost:.2f}x, highest "
              "round {cost_hi:.2f}x).", chosen in meeting, gap=GAP_TARGET, ttft=TTFT_TARGET,
              listed=listed, meeting=", ".join(f"{b:,}" for b in meeting) or "none",
              where=where, chosen=chosen,
              cut=at.get("gap_cut", math.nan), cut_lo=at.get("gap_cut_low", math.nan),
              cost=at.get("ttft_cost", math.nan), cost_hi=at.get("ttft_cost_high", math.nan),
              recorded=recorded)]


def from_recorded(data: dict) -> list[Interference]:
    return [Interference.from_dict(d) for d in data["runs"]]


def record(budgets: Sequence[int] = (512, 1024, 2048), long_prompt: int = 16000) -> dict:
    """`make record`: the sweep on bench_1b (bf16) at notebook 07's sizes, mixed steps
    replayed piecewise."""
    import torch

    from labkit.engine import ModelConfig, random_model

    config = ModelConfig.bench_1b(max_position_embeddings=long_prompt + 64)
    model = random_model(config, seed=0, device=torch.device("cuda"))
    runs = budget_sweep(model, budgets=budgets, cudagraph_mode="full_and_piecewise",
                        long_prompt=long_prompt, kv_cache_memory=8 * 2**30)
    return {"budgets": list(budgets), "long_prompt": long_prompt,
            "runs": [r.to_dict() for r in runs]}
