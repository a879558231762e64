"""The block map: who holds which block, what is shared, ref counts, as a story of requests
that arrive, grow, fork and finish (a widget and papermill call the same :func:`show_block_map`).
"""
from __future__ import annotations

import plotly.graph_objects as go

from labkit.kvcache.block_manager import BlockManager
from labkit.teaching.truth import headless

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
