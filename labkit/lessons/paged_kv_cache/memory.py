"""Contiguous preallocation against paged blocks, driven by the real :class:`BlockManager`.

Every request of a contiguous cache reserves ``max_model_len`` slots up front (the worst case:
it might grow that long); a paged request takes blocks as it grows. On request lengths drawn
like chat traffic: how many requests fit in the same memory, and how much of it holds tokens,
by block size.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from labkit.kvcache.block_manager import BlockManager, OutOfBlocks


def sample_requests(num_requests: int, max_model_len: int = 4096, seed: int = 0
                    ) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs with the long right tails of chat traces: log-normal,
    median prompt ~250 tokens, median answer ~200, capped so each fits ``max_model_len``."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(5.5, 1.0, num_requests), 4, max_model_len // 2).astype(int)
    output = np.clip(rng.lognormal(5.3, 0.8, num_requests), 1, max_model_len - prompt).astype(int)
    return list(zip(prompt.tolist(), output.tolist()))


def contiguous_fit(requests, capacity_tokens: int, max_model_len: int) -> dict:
    """Each request reserves max_model_len slots up front: it might grow that long."""
    fit = min(len(requests), capacity_tokens // max_model_len)
    stored = sum(p + o for p, o in requests[:fit])
    return {"scheme": "contiguous", "requests_fit": fit, "tokens_stored": stored,
            "slots_reserved": fit * max_model_len}


def paged_fit(requests, capacity_tokens: int, block_size: int) -> dict:
    """Requests take blocks as they grow (prompt, then one token at a time) until one would not
    fit; counted at every request's full length, its worst moment."""
    bm = BlockManager(max(1, capacity_tokens // block_size), block_size,
                      enable_prefix_caching=False)
    fit = stored = 0
    for i, (prompt_len, output_len) in enumerate(requests):
        try:
            bm.allocate(i, [0] * prompt_len)
            for _ in range(output_len):
                bm.append_token(i, 0)
        except OutOfBlocks:
            if i in bm:
                bm.free(i)
            break
        fit, stored = fit + 1, stored + prompt_len + output_len
    return {"scheme": f"paged (block {block_size})", "requests_fit": fit, "tokens_stored": stored,
            "slots_reserved": bm.stats.blocks_in_use * block_size}


def compare_memory(requests, capacities: list[int], max_model_len: int, block_size: int
                   ) -> pd.DataFrame:
    rows = []
    for cap in capacities:
        for row in (contiguous_fit(requests, cap, max_model_len),
                    paged_fit(requests, cap, block_size)):
            rows.append({"capacity_tokens": cap, **row})
    df = pd.DataFrame(rows)
    df["utilisation"] = df.tokens_stored / df.slots_reserved.clip(lower=1)
    return df


def plot_requests_fit(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for scheme, part in df.groupby("scheme", sort=False):
        fig.add_scatter(x=part.capacity_tokens, y=part.requests_fit, mode="lines+markers",
                        name=scheme, customdata=part.utilisation,
                        hovertemplate="%{y} requests in %{x:,} slots<br>"
                                      "utilisation %{customdata:.0%}<extra></extra>")
    fig.update_layout(title="Requests that fit in the same KV memory", height=380,
                      xaxis_title="KV cache capacity (token slots)", yaxis_title="requests held")
    return fig


def utilisation_by_block_size(requests, capacity_tokens: int, max_model_len: int,
                              block_sizes=(8, 16, 32, 64, 128, 256)) -> pd.DataFrame:
    rows = [contiguous_fit(requests, capacity_tokens, max_model_len)]
    rows += [paged_fit(requests, capacity_tokens, bs) for bs in block_sizes]
    df = pd.DataFrame(rows)
    df["utilisation"] = df.tokens_stored / df.slots_reserved.clip(lower=1)
    return df


def plot_utilisation(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure(go.Bar(x=df.scheme, y=df.utilisation, text=[f"{u:.0%}" for u in df.utilisation],
                           marker_color=["#d62728"] + ["#1f77b4"] * (len(df) - 1)))
    fig.update_layout(title="Share of reserved KV memory that holds tokens", height=360,
                      yaxis_tickformat=".0%", yaxis_range=[0, 1.05])
    return fig
