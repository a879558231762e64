"""The real forward of a prefill or a decode step, timed. ``forward_step`` runs a LlamaModel
over a contiguous KV cache on fixed tensors, so a CUDA Graph can capture it; ``time_forwards``
times it eagerly and replayed, in interleaved rounds beside the op-issue floor, and places each
shape on the roofline by its cost (``cost.forward_cost``); ``record`` is `make record`'s."""
from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.device import free_memory
from labkit.engine.config import ModelConfig
from labkit.engine.model import LlamaModel
from labkit.engine.weights import random_model
from labkit.graphs import capture_graph
from labkit.lessons.prefill_vs_decode.cost import KINDS, ForwardShape, decode, forward_cost, prefill
from labkit.measure import bench

MODES = ("eager", "graph")


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


def op_issue_floor(model: LlamaModel, kind: str, repeats: int = 10) -> float:
    """ms to issue one forward's ops with almost no arithmetic (the same layers and heads at
    head_dim 2, one token): what every eager step costs the host whatever its sizes, and what
    a replay does not pay. ``time_forwards`` times it in the same rounds as the real steps."""
    tiny = _issue_skeleton(model)
    return time_forward(tiny, ForwardShape(kind, 1, 1, 1), repeats=repeats).median_us / 1e3


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


# --------------------------------------------------------------------------- make record
GPU_SHAPES = (*[prefill(s) for s in (16, 64, 256, 1024, 4096)],
              *[decode(b, 1024) for b in (1, 4, 16, 64, 256)])


def record(device="cuda", config: ModelConfig | None = None,
           shapes: Sequence[ForwardShape] | None = None, engine: dict | None = None,
           rounds: int = 5, repeats: int = 10) -> dict:
    """`make record`: bench_1b (bf16) on the roofline eager and replayed, plain and with the
    fused layer ops (``fused``), each shape's cases and its op-issue floor in ``rounds``
    interleaved rounds of ``repeats`` samples; profiles of an eager decode and long prefill (and the fused decode);
    a decode step's time against 4x its context (``context_growth``, replayed);
    ``chunked_prefill.record_engine``; and on a GPU batch-1 decode one change at a time
    (``ladder``)."""
    from labkit.lessons.prefill_vs_decode import chunked_prefill, ladder
    from labkit.measure import peaks
    from labkit.measure.profile import trace

    dev, config = torch.device(device), config or ModelConfig.bench_1b()
    model = random_model(config, seed=0, device=dev)
    shapes = list(shapes or GPU_SHAPES)
    modes = MODES if dev.type == "cuda" else ("eager",)
    both = time_forwards(model, shapes, modes, repeats, rounds=rounds, fused_ops=(False, True))
    points, fused_points = both[~both.fused], both[both.fused]
    prefills, decodes = ([s for s in shapes if s.kind == k] for k in KINDS)
    profiled = prefills[-1:] + decodes[:1]  # as listed: the longest prefill, smallest decode
    fused = {"points": fused_points.to_dict(orient="list"),
             "profiles": {s.name: trace(forward_step(model, s, fused_ops=True), device=dev).summary
                          for s in decodes[:1]}}
    smallest = min(decodes, key=lambda s: s.batch)
    ceilings = peaks.ceilings(dev, quick=dev.type != "cuda")
    data = {"config": config.to_dict(), "peaks": ceilings,
            "points": points.to_dict(orient="list"), "fused": fused,
            "profiles": {s.name: trace(forward_step(model, s), device=dev).summary
                         for s in profiled},
            "context_growth": context_growth(model, 16, smallest.context, 4, modes[-1],
                                             rounds=rounds),
            "engine": chunked_prefill.record_engine(model, **(engine or {}))}
    if dev.type == "cuda":  # the engine's decode graph at batch 1, one change at a time
        data["ladder"] = ladder.ladder(model, context=smallest.context, rounds=rounds,
                                       copy_gbps=ceilings["copy_GBps"])
    return data
