"""Prefix caching on a workload whose requests share system prompts: hit rate, blocks saved and
evictions as the pool shrinks, counted by the real :class:`BlockManager` (bookkeeping only: the
time a hit saves is measured through the engine in :mod:`.prefix_ttft`)."""
from __future__ import annotations

from collections import deque

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from labkit.kvcache.block_manager import BlockManager, OutOfBlocks


def chat_workload(num_requests: int, num_apps: int = 6, system_len: int = 512,
                  user_len: tuple[int, int] = (16, 128), seed: int = 0) -> list[list[int]]:
    """Requests to a few apps, each with its own system prompt; popular apps are asked more
    (Zipf-like), and every request ends with its own question."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1000, 100_000, system_len).tolist() for _ in range(num_apps)]
    popularity = 1 / np.arange(1, num_apps + 1)
    apps = rng.choice(num_apps, size=num_requests, p=popularity / popularity.sum())
    return [systems[a] + rng.integers(1000, 100_000, rng.integers(*user_len)).tolist()
            for a in apps]


def run_prefix_workload(prompts: list[list[int]], num_blocks: int, block_size: int = 16,
                        enable_prefix_caching: bool = True, max_running: int = 4,
                        output_len: int = 32) -> dict:
    """Serve the prompts in order, at most ``max_running`` at once; each decodes ``output_len``
    tokens. When the pool is full the oldest request finishes first."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    running: deque[int] = deque()
    computed = 0
    for i, prompt in enumerate(prompts):
        while True:
            if len(running) < max_running:
                try:
                    computed += len(prompt) - bm.allocate(i, prompt)
                    break
                except OutOfBlocks:
                    if not running:
                        raise
            bm.free(running.popleft())
        running.append(i)
        for t in range(output_len):
            while not bm.can_append(i) and running[0] != i:
                bm.free(running.popleft())
            if not bm.can_append(i):
                break  # alone and out of room: it stops early (an engine would preempt)
            bm.append_token(i, t)
    s = bm.stats
    return {"num_blocks": num_blocks, "prefix_caching": enable_prefix_caching,
            "hit_rate": s.hit_rate, "blocks_saved": s.hits, "evictions": s.evictions,
            "prompt_tokens": s.prompt_tokens, "prefill_tokens_computed": computed}


def plot_hit_rate_vs_pool(df: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    fig.add_scatter(x=df.num_blocks, y=df.hit_rate, name="hit rate", mode="lines+markers")
    fig.add_scatter(x=df.num_blocks, y=df.evictions, name="evictions", mode="lines+markers",
                    yaxis="y2")
    fig.update_layout(title="Prefix cache under memory pressure", height=380,
                      xaxis_title="KV pool size (blocks)", yaxis=dict(title="hit rate",
                      tickformat=".0%", range=[0, 1]),
                      yaxis2=dict(title="evictions", overlaying="y", side="right"))
    return fig
