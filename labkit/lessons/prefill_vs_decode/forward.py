"""Prefill against decode: where one forward sits on the roofline, and why CUDA Graphs help
one and not the other. ``forward_cost`` counts a forward's FLOPs and bytes from its shapes;
``forward_step`` is the real forward of a LlamaModel over a contiguous KV cache, on fixed
tensors so a CUDA Graph can capture it; ``time_forwards`` times it eagerly and replayed
and places each shape on the roofline."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from labkit import check_positive_int
from labkit.device import free_memory
from labkit.measure import bench
from labkit.engine.config import ModelConfig
from labkit.engine.model import LlamaModel
from labkit.engine.weights import random_model
from labkit.graphs import capture_graph

KINDS = ("prefill", "decode")
MODES = ("eager", "graph")


@dataclass(frozen=True)
class ForwardShape:
    """``batch`` sequences of ``tokens`` new tokens each, the last over ``context`` KV tokens."""
    kind: str
    batch: int
    tokens: int
    context: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("batch", "tokens", "context"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)  # a NumPy int from a table is fine
            object.__setattr__(self, name, check_positive_int(name, value))
        if self.context < self.tokens:
            raise ValueError(f"context ({self.context}) must hold the {self.tokens} new tokens")

    @property
    def name(self) -> str:
        return (f"prefill S={self.tokens}" + (f" x{self.batch}" if self.batch > 1 else "")
                if self.kind == "prefill" else f"decode B={self.batch} ctx {self.context}")


def prefill(seq_len: int, batch: int = 1) -> ForwardShape:
    """``batch`` prompts of ``seq_len`` tokens, nothing cached before them."""
    return ForwardShape("prefill", batch, seq_len, seq_len)


def decode(batch: int, context: int) -> ForwardShape:
    """One new token for each of ``batch`` sequences, each over ``context`` tokens of KV."""
    return ForwardShape("decode", batch, 1, context)


def forward_cost(config: ModelConfig, shape: ForwardShape, dtype_bytes: int | None = None
                 ) -> dict:
    """FLOPs and bytes of one forward: the least an ideal implementation moves.

    Weights are read once per forward; each sequence reads its KV once and writes its new K/V;
    each matmul reads its input and writes its output (norms, RoPE and SiLU are left out).
    Attention counts the (query, key) pairs it needs: causal prefill S(S+1)/2, decode C.
    """
    c, e = config, dtype_bytes or config.dtype.itemsize
    h, q, kv, i, L, V = (c.hidden_size, c.q_size, c.kv_size, c.intermediate_size,
                         c.num_hidden_layers, c.vocab_size)
    T, rows = shape.batch * shape.tokens, shape.batch  # each sequence samples its last token
    matmul_params = h * (q + 2 * kv) + q * h + 3 * h * i
    past = shape.context - shape.tokens
    pairs = shape.batch * (shape.tokens * past + shape.tokens * (shape.tokens + 1) // 2)
    cost = {"linear_flops": 2 * T * L * matmul_params + 2 * rows * V * h,
            "attention_flops": 4 * c.num_attention_heads * c.head_dim * L * pairs,
            "weight_bytes": e * (L * (matmul_params + 2 * h) + h + V * h),
            "kv_bytes": e * L * 2 * kv * shape.batch * (shape.tokens + shape.context),
            "activation_bytes": e * (T * h + L * T * (4 * h + 2 * q + 2 * kv + 3 * i)
                                     + rows * (h + V))}
    flops = cost["linear_flops"] + cost["attention_flops"]
    nbytes = cost["weight_bytes"] + cost["kv_bytes"] + cost["activation_bytes"]
    return {"shape": shape.name, "kind": shape.kind, "batch": shape.batch,
            "tokens": shape.tokens, "context": shape.context, **cost, "flops": flops,
            "bytes": nbytes, "flops_per_byte": flops / nbytes}


def cost_table(config: ModelConfig, shapes: Sequence[ForwardShape],
               dtype_bytes: int | None = None) -> pd.DataFrame:
    """The arithmetic behind each roofline point, one row per shape, in GFLOP and MB."""
    df = pd.DataFrame([forward_cost(config, s, dtype_bytes) for s in shapes]).set_index("shape")
    scale = {c: 1e9 if c.endswith("flops") else 1e6 for c in df.columns if c.endswith(("flops",
             "bytes"))}
    out = (df[list(scale)] / pd.Series(scale)).rename(
        columns=lambda c: c.replace("flops", "GFLOP").replace("bytes", "MB"))
    return out.assign(flops_per_byte=df.flops_per_byte)


def decode_intensity(config: ModelConfig, batch: int, context: int,
                     dtype_bytes: int | None = None) -> float:
    """FLOPs per byte of a decode step; ``context=0``: the weights alone (no KV, no attention)."""
    d = forward_cost(config, decode(batch, max(context, 1)), dtype_bytes)
    return d["linear_flops"] / (d["bytes"] - d["kv_bytes"]) if context == 0 else \
        d["flops_per_byte"]


def knee_batch(config: ModelConfig, context: int, ridge: float, dtype_bytes: int | None = None,
               max_batch: int = 2**20) -> int | None:
    """Smallest decode batch at ``ridge`` FLOPs per byte or more (compute-bound), or None: each
    row's KV read adds bytes as its attention adds FLOPs, so long contexts level off below."""
    lo, hi = 1, max_batch
    if decode_intensity(config, hi, context, dtype_bytes) < ridge:  # grows with the batch
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if decode_intensity(config, mid, context, dtype_bytes) < ridge \
            else (lo, mid)
    return lo


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                     ) -> torch.Tensor:
    """q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, C, D] -> [B, Hq, D]. A KV head's query heads
    are its query rows, so SDPA reads each cached K/V once."""
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, -1, group, D), k_cache, v_cache)
    return out.reshape(B, Hq, D)


def decode_attention_ref(q, k_cache, v_cache) -> torch.Tensor:
    """The same in float32, each query head against its KV head's repeated cache."""
    group = q.shape[1] // k_cache.shape[1]
    k, v = (x.float().repeat_interleave(group, 1) for x in (k_cache, v_cache))
    scores = torch.einsum("bhd,bhcd->bhc", q.float(), k) * q.shape[-1] ** -0.5
    return torch.einsum("bhc,bhcd->bhd", scores.softmax(-1), v).to(q.dtype)


def forward_step(model: LlamaModel, shape: ForwardShape, seed: int = 0, *,
                 fused_ops: bool | None = None) -> Callable[[], torch.Tensor]:
    """A zero-argument forward of ``shape`` -> logits [batch, vocab], on fixed tensors.

    Prefill attends causally within each prompt. Decode writes each row's new K/V at position
    ``context - 1`` of a random cache [batch, Hkv, context, D] per layer and attends over all
    of it. Nothing is read back to the host, so a CUDA Graph can capture the call (keep the
    callable while the graph replays: the graph reads its tensors but holds no reference).
    ``fused_ops``: the layers' small ops fused or plain (None: the model's own choice).
    """
    c, dev, dtype = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    B, S, C = shape.batch, shape.tokens, shape.context
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    gen = torch.Generator(device=dev).manual_seed(seed)  # GBs of cache: fill them in place
    input_ids = torch.randint(0, c.vocab_size, (B * S,), generator=gen, device=dev)
    positions = torch.arange(C - S, C, device=dev).repeat(B)
    last_rows = torch.arange(S - 1, B * S, S, device=dev)
    cache = None if shape.kind == "prefill" else [[torch.randn(
        B, Hkv, C, D, generator=gen, device=dev, dtype=dtype) for _ in "kv"]
        for _ in range(c.num_hidden_layers)]

    def attention(layer, q, k, v):  # q: [B*S, Hq, D]; k, v: [B*S, Hkv, D]
        if cache is not None:
            k_cache, v_cache = cache[layer]
            k_cache[:, :, C - 1] = k.view(B, Hkv, D)
            v_cache[:, :, C - 1] = v.view(B, Hkv, D)
            return decode_attention(q.view(B, Hq, D), k_cache, v_cache)
        q, k, v = (x.view(B, S, -1, D).transpose(1, 2) for x in (q, k, v))
        k, v = (x.repeat_interleave(Hq // Hkv, 1) for x in (k, v))  # what the flash kernel takes
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(B * S, Hq, D)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model.hidden_states(input_ids, positions, attention,
                                                        fused_ops=fused_ops)[last_rows])
    return step


def time_forward(model: LlamaModel, shape: ForwardShape, mode: str = "eager", *,
                 warmup: int = 2, repeats: int = 10, fused_ops: bool | None = None
                 ) -> bench.Timing:
    """One forward launched op by op ("eager") or replayed from a CUDA Graph ("graph")."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dev, step = model.embed_tokens.device, forward_step(model, shape, fused_ops=fused_ops)
    if mode == "graph":
        if dev.type != "cuda":
            raise ValueError("mode='graph' needs the model on a CUDA device; on CPU compare "
                             "'eager' with op_issue_floor() instead")
        graph = capture_graph(step, warmup=warmup)[0]  # it reads step's tensors: keep step alive
        return bench.measure(graph.replay, device=dev, warmup=warmup, repeats=repeats)
    return bench.measure(step, device=dev, warmup=warmup, repeats=repeats)


def _issue_skeleton(model: LlamaModel) -> LlamaModel:
    """The same layers and heads at head_dim 2 and width 2: its forward issues the real model's
    ops with almost no arithmetic behind them."""
    c = model.config
    skeleton = ModelConfig(hidden_size=2 * c.num_attention_heads, intermediate_size=2,
                           num_hidden_layers=c.num_hidden_layers, vocab_size=2, head_dim=2,
                           num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, torch_dtype=c.torch_dtype)
    return random_model(skeleton, seed=0, device=model.embed_tokens.device,
                        dtype=model.embed_tokens.dtype)


def time_forwards(model: LlamaModel, shapes: Sequence[ForwardShape],
                  modes: Sequence[str] = ("eager",), repeats: int = 10, *, rounds: int = 3,
                  fused_ops: Sequence[bool | None] = (None,), floor: bool = True
                  ) -> pd.DataFrame:
    """Each shape in each mode (and each ``fused_ops`` choice), timed in interleaved rounds:
    per shape, every case once per round (eager, graph, fused eager, ..., and with ``floor``
    the op-issue floor of its kind, :func:`op_issue_floor`), so a drift of the machine lands on
    all of them alike. One row per (shape, mode, fused): ``ms`` is the median of the round
    medians and ``ms_low``/``ms_high`` its range; TFLOP/s and GB/s at the median (their ranges
    from ``ms_high``/``ms_low``); ``floor_ms`` (and its range) the floor timed in those rounds."""
    from labkit.measure.rounds import interleaved

    dev, skeleton = model.embed_tokens.device, _issue_skeleton(model) if floor else None
    rows = []
    for shape in shapes:
        cost = forward_cost(model.config, shape, model.embed_tokens.element_size())
        cases, keep = {}, []  # keep: each graph reads its step's tensors, so keep the step
        for fused in fused_ops:
            for mode in modes:
                cases[(mode, fused)], step = _runner(model, shape, mode, fused)
                keep.append(step)
        if floor:
            cases["floor"] = forward_step(skeleton, ForwardShape(shape.kind, 1, 1, 1))
        named = {str(k): v for k, v in cases.items()}
        timed = interleaved(named, rounds=rounds, device=dev, repeats=repeats)
        spread = {k: timed.us(str(k)) for k in cases}
        fl = spread.get("floor")
        for key in (k for k in cases if k != "floor"):
            mode, fused = key
            t = spread[key]
            ms, lo, hi = t.median / 1e3, t.low / 1e3, t.high / 1e3
            rows.append({**cost, "mode": mode, "fused": bool(fused), "ms": ms, "ms_low": lo,
                         "ms_high": hi, "tflops": cost["flops"] / ms / 1e9,
                         "tflops_low": cost["flops"] / hi / 1e9,
                         "tflops_high": cost["flops"] / lo / 1e9,
                         "gbps": cost["bytes"] / ms / 1e6, "rounds": t.rounds,
                         **({"floor_ms": fl.median / 1e3, "floor_low": fl.low / 1e3,
                             "floor_high": fl.high / 1e3} if fl is not None else {})})
        del cases, named, keep
        free_memory(dev)  # a decode's cache can take tens of GB
    return pd.DataFrame(rows)


def _runner(model: LlamaModel, shape: ForwardShape, mode: str, fused_ops: bool | None):
    """(the zero-argument call to time, the step it runs: keep it while a graph replays)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    step = forward_step(model, shape, fused_ops=fused_ops)
    if mode == "eager":
        return step, step
    if model.embed_tokens.device.type != "cuda":
        raise ValueError("mode='graph' needs the model on a CUDA device; on CPU compare "
                         "'eager' with op_issue_floor() instead")
    return capture_graph(step, warmup=2)[0].replay, step


def graph_gain(points: pd.DataFrame) -> pd.DataFrame:
    """Per shape: eager and graph-replay ms and the replay's speed-up."""
    wide = points.pivot_table(index=["shape", "kind"], columns="mode", values="ms", sort=False)
    return wide.assign(speedup=wide["eager"] / wide["graph"]).reset_index()


def fused_gain(points: pd.DataFrame, fused: pd.DataFrame, copy_gbps: float) -> pd.DataFrame:
    """Per shape and mode measured both ways: ms with the small ops as separate kernels and as
    fused ones (``LlamaModel.fused_ops``), the speed-up, and each one's share of the copy
    bandwidth (the step's bytes over its time)."""
    keys = ["shape", "kind", "mode"]
    both = points.merge(fused, on=keys, suffixes=("", "_fused"))
    return pd.DataFrame({
        **{k: both[k] for k in keys}, "ms": both.ms, "ms_fused": both.ms_fused,
        "speedup": both.ms / both.ms_fused, "share_of_copy": both.gbps / copy_gbps,
        "share_of_copy_fused": both.gbps_fused / copy_gbps})


def op_issue_floor(model: LlamaModel, kind: str, repeats: int = 10) -> float:
    """ms to issue one forward's ops with almost no arithmetic (the same layers and heads at
    head_dim 2, one token): what every eager step costs the host whatever its sizes, and what
    a replay does not pay. ``time_forwards`` times it in the same rounds as the real steps."""
    tiny = _issue_skeleton(model)
    return time_forward(tiny, ForwardShape(kind, 1, 1, 1), repeats=repeats).median_us / 1e3


def overhead_table(points: pd.DataFrame) -> pd.DataFrame:
    """Per eager point, what bounds it. ``points`` carries ``floor_ms`` (the op-issue floor
    timed in the same rounds, see ``time_forwards``).

    On a GPU launches are asynchronous: the host issues op i+1 while the GPU runs op i, so an
    eager step takes about ``max(issue floor, GPU time)``, not their sum. A graph replay pays no
    host issue, so its time is the GPU time. ``model_ms`` is that max, ``bound`` names the
    larger term and ``model_error`` is eager / model - 1. Without a replay (a CPU, where the
    same thread issues each op and then computes it) the two add up: ``floor_share`` is the
    floor over the eager step, and a share above 1 means the floor did not measure issue cost
    alone (it is kept, not clipped: ``floor_over_step`` marks it)."""
    eager = points[points["mode"] == "eager"].reset_index(drop=True)
    if "fused" in eager:
        eager = eager[~eager.fused.astype(bool)].reset_index(drop=True)
    out = eager[["shape", "kind", "flops_per_byte", "ms", "floor_ms"]].rename(
        columns={"floor_ms": "issue_floor_ms"})
    out["floor_share"] = out.issue_floor_ms / out.ms
    out["floor_over_step"] = out.floor_share > 1
    if "graph" in set(points["mode"]):
        graph = points[points["mode"] == "graph"]
        if "fused" in graph:
            graph = graph[~graph.fused.astype(bool)]
        gpu = out["shape"].map(graph.set_index("shape").ms)
        out["gpu_ms"] = gpu
        out["model_ms"] = pd.concat([out.issue_floor_ms, gpu], axis=1).max(axis=1)
        out["bound"] = ["host" if f >= g else "GPU" for f, g in zip(out.issue_floor_ms, gpu)]
        out["model_error"] = out.ms / out.model_ms - 1
    return out


# --------------------------------------------------------------------------- figures
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


# --------------------------------------------------------------------------- make record
GPU_SHAPES = (*[prefill(s) for s in (16, 64, 256, 1024, 4096)],
              *[decode(b, 1024) for b in (1, 4, 16, 64, 256)])


def context_growth(model: LlamaModel, batch: int, context: int, factor: int = 4,
                   mode: str = "eager", *, rounds: int = 5, repeats: int = 10) -> dict:
    """A decode step of ``batch`` rows over ``context`` and ``factor`` times that, timed in
    interleaved rounds in ``mode``: the time ratio (long / short, per round) beside how much
    its bytes and its FLOPs grow."""
    from labkit.measure.rounds import interleaved

    longer = min(factor * context, model.config.max_position_embeddings)
    shapes = {"short": decode(batch, context), "long": decode(batch, longer)}
    runners = {k: _runner(model, s, mode, None) for k, s in shapes.items()}
    timed = interleaved({k: r[0] for k, r in runners.items()}, rounds=rounds,
                        device=model.embed_tokens.device, repeats=repeats)
    cost = {k: forward_cost(model.config, s, model.embed_tokens.element_size())
            for k, s in shapes.items()}
    ratio = timed.ratio("long", "short")
    return {"batch": batch, "context": context, "long_context": longer, "mode": mode,
            "short_us": timed.us("short").values, "long_us": timed.us("long").values,
            "ratio": ratio.values, "bytes_ratio": cost["long"]["bytes"] / cost["short"]["bytes"],
            "flops_ratio": cost["long"]["flops"] / cost["short"]["flops"]}


def record(device="cuda", config: ModelConfig | None = None,
           shapes: Sequence[ForwardShape] | None = None, engine: dict | None = None,
           rounds: int = 5) -> dict:
    """`make record`: bench_1b (bf16) on the roofline eager and replayed, plain and with the
    fused layer ops (``fused``), each shape's cases and its op-issue floor in ``rounds``
    interleaved rounds; profiles of an eager decode and long prefill (and the fused decode);
    a decode step's time against 4x its context (``context_growth``, replayed); and
    ``chunked_prefill.record_engine``."""
    from labkit.lessons.prefill_vs_decode import chunked_prefill
    from labkit.measure import peaks
    from labkit.measure.profile import trace

    dev, config = torch.device(device), config or ModelConfig.bench_1b()
    model = random_model(config, seed=0, device=dev)
    shapes = list(shapes or GPU_SHAPES)
    modes = MODES if dev.type == "cuda" else ("eager",)
    both = time_forwards(model, shapes, modes, rounds=rounds, fused_ops=(False, True))
    points, fused_points = both[~both.fused], both[both.fused]
    prefills, decodes = ([s for s in shapes if s.kind == k] for k in KINDS)
    profiled = prefills[-1:] + decodes[:1]  # as listed: the longest prefill, smallest decode
    fused = {"points": fused_points.to_dict(orient="list"),
             "profiles": {s.name: trace(forward_step(model, s, fused_ops=True), device=dev).summary
                          for s in decodes[:1]}}
    smallest = min(decodes, key=lambda s: s.batch)
    return {"config": config.to_dict(), "peaks": peaks.ceilings(dev, quick=dev.type != "cuda"),
            "points": points.to_dict(orient="list"), "fused": fused,
            "profiles": {s.name: trace(forward_step(model, s), device=dev).summary
                         for s in profiled},
            "context_growth": context_growth(model, 16, smallest.context, 4, modes[-1],
                                             rounds=rounds),
            "engine": chunked_prefill.record_engine(model, **(engine or {}))}
