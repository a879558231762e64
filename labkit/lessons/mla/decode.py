"""MLA decode measured on a GPU: paged_mla_attention replayed from CUDA Graphs at DeepSeek-V3's
widths beside GQA decode, against the copy bandwidth and a bf16 matmul timed in the same rounds
(notebook 10, section 4; benchmarks/mla_decode.py)."""
from __future__ import annotations

import math

import pandas as pd
import torch

from labkit.lessons.mla.cache_bytes import mla_flops, roof_us
from labkit.lessons.mla.shapes import BLOCK, RANK, ROPE, SCALE
from labkit.teaching import claim

ROWS_ON_M = "MLA, rows on M (16 heads)"  # the case timing the other tile orientation


def replayed(fn):
    """A replay of ``fn`` captured; it holds ``fn`` (the graph holds no reference to the tensors
    it reads and writes, so without it they would be freed and the replay read others' memory)."""
    from labkit.graphs import capture_graph
    graph, _ = capture_graph(fn)

    def replay():
        graph.replay()
    replay.captured = fn
    return replay


def decode_inputs(batch: int, heads: int, ctx: int, seed=0, device="cuda") -> tuple:
    """One decode step's tensors at DeepSeek-V3's widths, bf16: (q_latent, q_rope, latent_cache,
    block_tables, cu_seqlens_q, seq_lens, out), every sequence ``ctx`` tokens long over blocks of
    64 scattered across the cache."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(ctx / BLOCK)
    table = torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(device)
    cache = torch.randn(table.numel(), BLOCK, RANK + ROPE, device=device, dtype=torch.bfloat16)
    q_latent = torch.randn(batch, heads, RANK, device=device, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, ROPE, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q_latent, q_rope, cache, table, cu, lens, torch.empty_like(q_latent)


def latent_decode(batch: int, heads: int, ctx: int, num_splits: int | None = None, seed=0,
                  device="cuda", keys_on_m: bool | None = None):
    """(a replay of one paged_mla_attention decode call on ``decode_inputs``, the bytes of
    latent cache it reads). ``keys_on_m`` forces the tile orientation (None: the planner's)."""
    from labkit.attention import paged_mla_attention
    from labkit.kernels.paged_mla_attention import plan_mla
    *args, out = decode_inputs(batch, heads, ctx, seed, device)
    if keys_on_m is None:
        call = lambda: paged_mla_attention(*args, scale=SCALE, check=False, max_query_len=1,
                                           num_splits=num_splits, out=out)
    else:
        plan = plan_mla(heads, RANK, args[2].shape, batch, ctx, 1, device, scale=SCALE,
                        num_splits=num_splits, keys_on_m=keys_on_m)
        call = lambda: plan.run(*args, out=out)
    return replayed(call), batch * ctx * (RANK + ROPE) * 2


def gqa_decode(batch: int, ctx: int, seed=0, device="cuda"):
    """The same decode for a GQA model (32 query / 8 KV heads of 128, blocks of 16)."""
    from labkit.attention import paged_attention
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(ctx / 16)
    table = torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(device)
    k, v = (torch.randn(table.numel(), 16, 8, 128, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    call = lambda: paged_attention(q, k, v, table, cu, lens, check=False, max_query_len=1)
    return replayed(call), 2 * batch * ctx * 8 * 128 * 2


def timed(cases: dict, nbytes: dict, rounds: int = 5, device="cuda", flush_l2: bool = False
          ) -> dict:
    """Each case's microseconds and GB/s over interleaved rounds: medians with their ranges
    (``flush_l2``: the L2 flushed between samples, for caches that fit in twice it)."""
    from labkit.measure.rounds import Spread, interleaved
    timings = interleaved(cases, rounds=rounds, device=device, warmup=3, repeats=20,
                          flush_l2=flush_l2)
    out = {}
    for name in cases:
        us = timings.us(name)
        gbps = Spread.of([nbytes[name] / (t * 1e-6) / 1e9 for t in us.values])
        out[name] = {"us": us.median, "us_range": [us.low, us.high],
                     "gbps": gbps.median, "gbps_range": [gbps.low, gbps.high],
                     "gbps_rounds": list(gbps.values)}
    return out


def roofs(rounds: int = 5, device="cuda") -> dict:
    """The two ceilings, timed here: a 2 GiB device copy (read + write counted) and a bf16
    8192^3 matmul. Returns copy GB/s (median and range), matmul TFLOP/s, and the ridge."""
    from labkit.measure.rounds import interleaved
    n = 2 * 2**30
    src = torch.empty(n // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = timed({"copy": lambda: dst.copy_(src)}, {"copy": 2 * n}, rounds, device)["copy"]
    del src, dst
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm = interleaved({"mm": lambda: a @ b}, rounds=rounds, device=device, warmup=3, repeats=20)
    matmul_tflops = 2 * 8192 ** 3 / (mm.us("mm").median * 1e6)
    return {"copy_gbps": copy["gbps"], "copy": copy, "matmul_tflops": matmul_tflops,
            "ridge": matmul_tflops * 1e3 / copy["gbps"]}


def rate(results: dict, shapes: dict, roof: dict) -> dict:
    """Adds to each timed case its share of the copy bandwidth per round (median and range)
    and, for MLA cases (``shapes``: name -> (batch, heads, ctx)), TFLOP/s, FLOPs per byte and
    the share of the tighter roof."""
    from labkit.measure.rounds import Spread
    for name, r in results.items():
        share = Spread.of([g / roof["copy_gbps"] for g in r["gbps_rounds"]])
        r["copy_share"], r["copy_share_range"] = share.median, [share.low, share.high]
        if name in shapes:
            flops = mla_flops(*shapes[name])
            nbytes = r["gbps"] * 1e3 * r["us"]
            r["tflops"] = flops / (r["us"] * 1e6)
            r["flops_per_byte"] = flops / nbytes
            r["roof_us"] = roof_us(nbytes, flops, roof["copy_gbps"], roof["matmul_tflops"])
            r["roof_share"] = r["roof_us"] / r["us"]
    return results


def measure_decode(rounds: int = 5, batch: int = 64, ctx: int = 4096, heads=(16, 128),
                   device="cuda") -> dict:
    """MLA decode at ``heads`` and GQA decode at ``batch`` x ``ctx``, in the same interleaved
    rounds, rated against roofs timed just before."""
    from labkit.device import free_memory
    roof = roofs(rounds, device)
    cases, nbytes, shapes = {}, {}, {}
    for h in heads:
        name = f"MLA {h} heads"
        cases[name], nbytes[name] = latent_decode(batch, h, ctx, device=device)
        shapes[name] = (batch, h, ctx)
    # at 16 heads the planner's other orientation, in the same rounds
    cases[ROWS_ON_M], nbytes[ROWS_ON_M] = latent_decode(batch, 16, ctx, device=device,
                                                        keys_on_m=False)
    shapes[ROWS_ON_M] = (batch, 16, ctx)
    cases["GQA 32/8 heads of 128"], nbytes["GQA 32/8 heads of 128"] = gqa_decode(
        batch, ctx, device=device)
    results = rate(timed(cases, nbytes, rounds, device), shapes, roof)
    del cases
    free_memory(device)
    return {**roof, "rounds": rounds, "batch": batch, "ctx": ctx, "cases": results}


MEASURED_EARLIER = "measured earlier in this gpu-check run by benchmarks/mla_decode.py"


def live_decode(rounds: int = 5, device="cuda") -> tuple[dict, str]:
    """Notebook 10's batch-64 decode figures on a GPU and where they come from: measured now
    (:func:`measure_decode`), or, inside ``make gpu-check``, which ran
    ``benchmarks/mla_decode.py`` on this machine before its notebooks, that run's results
    (``labkit.tools.run_results``): the same cases at the same shapes, not timed twice."""
    from labkit.tools.run_results import this_run
    saved = this_run("mla_decode.json")
    cases = (saved or {}).get("sections", {}).get("batch 64")
    if isinstance(cases, dict) and all(isinstance(r, dict) and "us" in r for r in cases.values()):
        return {**saved, "cases": cases}, MEASURED_EARLIER
    return measure_decode(rounds=rounds, device=device), "timed here"


def decode_table(measured: dict) -> pd.DataFrame:
    """One row per case: time, GB/s and share of copy with ranges, TFLOP/s, share of roof."""
    rows = []
    for name, r in measured["cases"].items():
        rows.append({"case": name, "us": r["us"],
                     "us range": f"{r['us_range'][0]:.1f}-{r['us_range'][1]:.1f}",
                     "GB/s": r["gbps"], "of copy": r["copy_share"],
                     "of copy range": "{:.0%}-{:.0%}".format(*r["copy_share_range"]),
                     "TFLOP/s": r.get("tflops", math.nan),
                     "FLOPs per byte": r.get("flops_per_byte", math.nan),
                     "of the tighter roof": r.get("roof_share", math.nan)})
    return pd.DataFrame(rows).set_index("case")


def share_span(lo: float, hi: float) -> str:
    """A range of shares as a reader takes it in: "57%" when both ends round alike."""
    a, b = f"{lo:.0%}", f"{hi:.0%}"
    return a if a == b else f"{a}-{b}"


def orientation_gain(measured: dict):
    """Per round, the rows-on-M plan's time over the planner's keys-on-M plan at 16 heads
    (same bytes, so the ratio of their GB/s), as a Spread; None where it was not measured."""
    from labkit.measure.rounds import Spread
    rows = measured["cases"].get(ROWS_ON_M)
    if rows is None:
        return None
    keys = measured["cases"]["MLA 16 heads"]
    return Spread.of([k / r for k, r in zip(keys["gbps_rounds"], rows["gbps_rounds"])])


def decode_claims(measured: dict, recorded=None) -> list:
    """What the measured decode shows: 16 heads under the ridge and bound by bytes, 128 heads
    over it and bound by FLOPs, keys on M faster than rows on M at 16 heads (where measured),
    and the whole range of rounds behind each statement."""
    cases, ridge = measured["cases"], measured["ridge"]
    low, high = cases["MLA 16 heads"], cases["MLA 128 heads"]
    gain = orientation_gain(measured)
    oriented = [] if gain is None else [
        claim("With 16 heads a program has 16 rows, too few for the 64 a warpgroup MMA wants on"
              " its M side: putting the 64-key tile there instead (keys on M) ran {g:.2f}x the "
              "rows-on-M plan, {lo:.2f}-{hi:.2f}x over the rounds.",
              gain.low > 1.0, g=gain.median, lo=gain.low, hi=gain.high, recorded=recorded)]
    return oriented + [
        claim("MLA decode at 16 heads does {i:.0f} FLOPs per byte, under the ridge of {ridge:.0f}:"
              " it read the latent cache at {span} of the copy bandwidth over the rounds.",
              low["flops_per_byte"] < ridge, i=low["flops_per_byte"], ridge=ridge,
              span=share_span(*low["copy_share_range"]), recorded=recorded),
        claim("At 128 heads the same cache costs {i:.0f} FLOPs per byte, over the ridge: the "
              "tensor cores bound it, so it reads only {span} of copy bandwidth while doing "
              "{tf:.0f} TFLOP/s, {roof:.0%} of the tighter of the two roofs.",
              high["flops_per_byte"] > ridge and high["copy_share_range"][1]
              < low["copy_share_range"][0], i=high["flops_per_byte"],
              span=share_span(*high["copy_share_range"]), tf=high["tflops"],
              roof=high["roof_share"], recorded=recorded),
    ]


def roofline_figure(measured: dict, where: str):
    """Each measured decode on the roofline: TFLOP/s against FLOPs per byte, under the two
    roofs timed in the same run."""
    import numpy as np
    import plotly.graph_objects as go
    copy, peak = measured["copy_gbps"], measured["matmul_tflops"]
    x = np.logspace(0, 3.5, 60)
    fig = go.Figure(go.Scatter(x=x, y=np.minimum(copy * x / 1e3, peak), mode="lines",
                               name="roof: min(copy x intensity, matmul)",
                               line=dict(color="#444")))
    for name, r in measured["cases"].items():
        if "flops_per_byte" in r:
            fig.add_trace(go.Scatter(x=[r["flops_per_byte"]], y=[r["tflops"]],
                                     mode="markers+text", text=[name], name=name,
                                     textposition="top center", marker=dict(size=12)))
        else:  # GQA: 2 * 32 / 8 FLOPs per byte for 32 query heads over 8 KV heads in bf16
            fig.add_trace(go.Scatter(x=[4.0], y=[4.0 * r["gbps"] / 1e3], mode="markers+text",
                                     text=[name], name=name, textposition="bottom center",
                                     marker=dict(size=12)))
    fig.update_layout(title=f"MLA and GQA decode on the roofline ({where})", height=460,
                      xaxis_type="log", yaxis_type="log", xaxis_title="FLOPs per byte",
                      yaxis_title="TFLOP/s", showlegend=False)
    return fig
