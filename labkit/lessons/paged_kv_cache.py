"""Notebook 05's experiments and pictures, all driven by the real :class:`BlockManager`.

- contiguous preallocation (every request reserves ``max_model_len`` slots) against paged blocks,
  on request lengths drawn like chat traffic: how many requests fit, how much memory holds tokens;
- the block map: who holds which block, what is shared, ref counts, as a story of requests that
  arrive, grow, fork and finish (a widget and papermill call the same :func:`show_block_map`);
- prefix caching on a workload whose requests share system prompts: hit rate, blocks saved, and
  evictions as the pool shrinks.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from labkit.kvcache.block_manager import BlockManager, OutOfBlocks
from labkit.teaching import claim
from labkit.teaching.truth import headless


# ---------------------------------------------------------------- contiguous vs paged
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


# ---------------------------------------------------------------- the block map
MAP_BLOCKS, MAP_BLOCK_SIZE = 16, 4
_SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]          # two full blocks, shared by A, B, D
STORY: list[tuple[str, str, tuple]] = [
    ("A arrives: system prompt + question, 10 tokens", "allocate", ("A", _SYSTEM + [1, 2])),
    ("B arrives with the same system prompt: its two full blocks are hits",
     "allocate", ("B", _SYSTEM + [3, 4, 5])),
    ("A and B decode 2 tokens each", "decode", (("A", "B"), 2)),
    ("C is forked from B (a second sample): it shares every block of B", "fork", ("B", "C")),
    ("C decodes: the shared, partly filled block is copied first (copy-on-write)",
     "decode", (("C",), 1)),
    ("A finishes: what only A held is released; its full blocks stay cached", "free", ("A",)),
    ("D arrives with A's prompt: A's full blocks are hits", "allocate", ("D", _SYSTEM + [1, 2, 9])),
    ("B, C and D finish: full blocks stay cached, evictable", "free", ("B", "C", "D")),
    ("E, a long unrelated prompt: the pool is short, least recently released blocks go",
     "allocate", ("E", list(range(500, 552)))),
]


def block_map_at(step: int) -> tuple[BlockManager, str, list[str]]:
    """Replay STORY[0..step] on a fresh manager; returns it, the step's title and a log."""
    if not 0 <= step < len(STORY):
        raise ValueError(f"step must be in [0, {len(STORY) - 1}], got {step}")
    bm = BlockManager(MAP_BLOCKS, MAP_BLOCK_SIZE)
    log = []
    for title, op, args in STORY[:step + 1]:
        if op == "allocate":
            hit = bm.allocate(*args)
            log.append(f"{args[0]}: {len(args[1])} tokens, {hit} from the prefix cache")
        elif op == "decode":
            for _ in range(args[1]):
                for seq in args[0]:
                    copies = bm.append_token(seq, 0)
                    log += [f"{seq}: copy-on-write block {s} -> {d}" for s, d in copies]
        elif op == "fork":
            bm.fork(*args)
        else:
            for seq in args:
                bm.free(seq)
    return bm, f"step {step}: {STORY[step][0]}", log


_OWNER_COLOURS = {"A": "#1f77b4", "B": "#2ca02c", "C": "#9467bd", "D": "#ff7f0e", "E": "#8c564b"}


def plot_block_map(bm: BlockManager, title: str = "", cols: int = 8) -> go.Figure:
    """One square per physical block: colour = owner, red frame = shared (ref count > 1),
    grey = cached but unused (evictable, hit-able), white = free."""
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    for seq in bm.seq_ids:
        n = bm.num_tokens(seq)
        for i, b in enumerate(bm.block_table(seq)):
            owners.setdefault(b, []).append(str(seq))
            fill[b] = min(bm.block_size, n - i * bm.block_size)
    evictable = bm.evictable_blocks()
    fig = go.Figure()
    xs, ys, texts, hovers = [], [], [], []
    for b in range(bm.num_blocks):
        x, y = b % cols, -(b // cols)
        ref = bm.ref_count(b)
        if ref:
            colour = _OWNER_COLOURS.get(owners[b][0], "#17becf")
            label = f"{','.join(owners[b])}<br>ref {ref}<br>{fill[b]}/{bm.block_size}"
        elif b in evictable:
            colour, label = "#c7c7c7", f"cached<br>LRU #{evictable.index(b)}"
        else:
            colour, label = "#ffffff", "free"
        fig.add_shape(type="rect", x0=x - 0.45, x1=x + 0.45, y0=y - 0.45, y1=y + 0.45,
                      fillcolor=colour, opacity=0.85,
                      line=dict(color="#d62728" if ref > 1 else "#444", width=4 if ref > 1 else 1))
        xs.append(x), ys.append(y), texts.append(f"<b>{b}</b><br>{label}")
        hovers.append(f"block {b}, ref_count {ref}, "
                      f"{'in the prefix cache' if bm.is_cached(b) else 'not cached'}")
    fig.add_scatter(x=xs, y=ys, mode="text", text=texts, hovertext=hovers, hoverinfo="text",
                    textfont=dict(size=10), showlegend=False)
    s = bm.stats
    fig.update_layout(
        title=f"{title}<br><sup>in use {s.blocks_in_use}, cached {s.blocks_cached}, free "
              f"{s.blocks_free}; hits {s.hits} blocks, evictions {s.evictions}</sup>",
        height=120 + 95 * -(-bm.num_blocks // cols), width=110 * cols, plot_bgcolor="white",
        xaxis=dict(visible=False, range=[-0.6, cols - 0.4]),
        yaxis=dict(visible=False, scaleanchor="x"), margin=dict(l=10, r=10, t=80, b=10))
    return fig


def show_block_map(step: int) -> go.Figure:
    bm, title, _ = block_map_at(step)
    return plot_block_map(bm, title)


def block_map_widget(step: int = 0):
    """A slider over STORY's steps that redraws :func:`show_block_map` in an Output widget.

    The figure is displayed *inside* ``with output:``: JupyterLab renders what the Output widget
    captured. Written into the widget's state instead (``append_display_data``), the plotly
    bundle is kept but never drawn in a live lab.
    """
    import ipywidgets as widgets
    from IPython.display import display

    slider = widgets.IntSlider(value=step, min=0, max=len(STORY) - 1, description="step",
                               continuous_update=False)
    output = widgets.Output()

    def redraw(change=None):
        with output:
            output.clear_output(wait=True)
            display(show_block_map(slider.value))

    slider.observe(redraw, names="value")
    if headless():  # nbclient can hang on an Output widget capturing during execution
        display(show_block_map(slider.value))
        return widgets.VBox([slider, output])
    redraw()
    return widgets.VBox([slider, output])


# ---------------------------------------------------------------- prefix caching
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


# ----------------------------------------------------------------------- what the notebook claims
def memory_claims(memory: pd.DataFrame, by_block: pd.DataFrame, block_size: int) -> list:
    """Paged against contiguous in the same memory, and what the block size costs, computed from
    :func:`compare_memory` and :func:`utilisation_by_block_size`."""
    contiguous = memory[memory.scheme == "contiguous"].set_index("capacity_tokens")
    paged = memory[memory.scheme != "contiguous"].set_index("capacity_tokens")
    gain = paged.requests_fit / contiguous.requests_fit
    blocks = by_block[by_block.scheme != "contiguous"]
    used = pd.Series(blocks.utilisation.values,
                     index=[int(name.split()[-1].rstrip(")")) for name in blocks.scheme])
    return [
        claim("The same memory holds {lo:.1f}x to {hi:.1f}x as many requests when they take "
              "blocks as they grow as when each reserves the worst case up front.",
              bool((gain >= 2).all()), lo=float(gain.min()), hi=float(gain.max())),
        claim("Paged, {p:.0%} of the reserved slots hold a token (the worst of the capacities "
              "tried); reserving max_model_len per request, {c:.0%}.",
              bool((paged.utilisation > 0.9).all() and (contiguous.utilisation < 0.5).all()),
              p=float(paged.utilisation.min()), c=float(contiguous.utilisation.max())),
        claim("Blocks of {b} tokens fill {small:.1%} of their slots, blocks of {big} only "
              "{large:.1%}: the last, partly filled block of each request wastes more the bigger "
              "the block.", bool(used.loc[block_size] > used.iloc[-1]), b=block_size,
              small=float(used.loc[block_size]), big=int(used.index[-1]),
              large=float(used.iloc[-1])),
    ]


def copy_on_write_claim(copies, reads_parent: bool):
    return claim("The forked request's append into the shared block was served by copy-on-write "
                 "{copies}, and it still reads its parent's prefix through its own block table.",
                 bool(copies) and bool(reads_parent), copies=list(copies))


def prefix_claims(on: dict, off: dict, pressure: pd.DataFrame) -> list:
    """Prefix caching on the chat workload (:func:`run_prefix_workload`, caching on and off) and
    as the pool shrinks."""
    by_pool = pressure.sort_values("num_blocks")
    small, large = by_pool.iloc[0], by_pool.iloc[-1]
    return [
        claim("With prefix caching, {hit:.0%} of the prompt blocks were found in the cache, and "
              "prefill computed {on_t:,} of the {off_t:,} tokens it computes without caching "
              "({share:.0%}).", on["hit_rate"] > 0.5 and off["hit_rate"] == 0
              and on["prefill_tokens_computed"] < 0.5 * off["prefill_tokens_computed"],
              hit=on["hit_rate"], on_t=on["prefill_tokens_computed"],
              off_t=off["prefill_tokens_computed"],
              share=on["prefill_tokens_computed"] / off["prefill_tokens_computed"]),
        claim("Shrinking the pool from {big:,} to {few:,} blocks lowers the hit rate from "
              "{hit_big:.0%} to {hit_few:.0%} and raises evictions from {ev_big:,} to {ev_few:,}: "
              "running requests crowd the cached blocks out.",
              bool(large.hit_rate > small.hit_rate and small.evictions > large.evictions),
              big=int(large.num_blocks), few=int(small.num_blocks), hit_big=float(large.hit_rate),
              hit_few=float(small.hit_rate), ev_big=int(large.evictions),
              ev_few=int(small.evictions)),
    ]
