"""Bytes per token and FLOPs per byte: what each attention scheme caches and what a decode step
does with it (notebook 10, sections 1 and 4)."""
from __future__ import annotations

import pandas as pd
import torch

from labkit import check_positive_int
from labkit.lessons.mla.shapes import RANK, ROPE
from labkit.lessons.paged_kv_cache.attention_memory import (DEEPSEEK_V3, GIB, AttentionDims,
                                                            cached_values_per_token_layer)
from labkit.teaching import claim


def scheme_table(dims: AttentionDims = DEEPSEEK_V3, gqa_kv_heads: int = 8,
                 bytes_per_value: int = 2, cache_gib: float = 64.0, context: int = 4096
                 ) -> pd.DataFrame:
    """MHA, GQA, MQA and MLA at ``dims``: values per token and layer, KiB per token (all
    layers), requests of ``context`` tokens that ``cache_gib`` holds, bytes over MLA's, and a
    decode's FLOPs per cached byte (``decode_intensity``)."""
    check_positive_int("context", context)
    if not cache_gib > 0:
        raise ValueError(f"cache_gib must be > 0, got {cache_gib!r}")
    rows = []
    for label, scheme, kv_heads in (
            (f"MHA ({dims.num_attention_heads} KV heads)", "MHA", None),
            (f"GQA ({gqa_kv_heads} KV heads)", "GQA", gqa_kv_heads),
            ("MQA (1 KV head)", "GQA", 1),
            (f"MLA (latent {dims.kv_lora_rank} + rope {dims.qk_rope_head_dim})", "MLA", None)):
        values = cached_values_per_token_layer(dims, scheme, kv_heads)
        per_token = values * dims.num_hidden_layers * bytes_per_value
        rows.append({"scheme": label, "values per token and layer": values,
                     "KiB per token": per_token / 1024,
                     "requests that fit": int(cache_gib * GIB // (per_token * context)),
                     "FLOPs per cached byte (decode)": decode_intensity(
                         dims, "MLA" if scheme == "MLA" else "MHA", bytes_per_value,
                         kv_heads=kv_heads or dims.num_attention_heads)})
    table = pd.DataFrame(rows)
    table["bytes vs MLA"] = table["KiB per token"] / table["KiB per token"].iloc[-1]
    return table


def decode_intensity(dims: AttentionDims, scheme: str, bytes_per_value: int = 2, *,
                     kv_heads: int | None = None, heads: int | None = None) -> float:
    """FLOPs a decode step does per byte of cache it reads (one new token per sequence).

    Per cached token every query head does a dot with its key and a multiply-add of its value:
    ``2 * heads * (k + v)`` FLOPs, where MHA/GQA/MQA ("MHA" here, with ``kv_heads``) read
    ``kv_heads * (k + v)`` values and absorbed MLA reads one row of ``rank + rope`` that serves
    as key (``rank + rope`` wide) and value (``rank``)."""
    heads = heads or dims.num_attention_heads
    if scheme == "MLA":
        row = dims.kv_lora_rank + dims.qk_rope_head_dim
        return 2 * heads * (row + dims.kv_lora_rank) / (row * bytes_per_value)
    kv_heads = kv_heads or heads
    return 2 * heads / (kv_heads * bytes_per_value)


def mla_flops(batch: int, heads: int, ctx: int, rank: int = RANK, rope: int = ROPE) -> int:
    """FLOPs of one absorbed MLA decode call: per head and cached token a ``rank + rope`` dot
    for the score and a ``rank``-wide multiply-add into the output (softmax not counted)."""
    return 2 * batch * heads * ctx * ((rank + rope) + rank)


def counted_flops_claim(heads: int = 16, context: int = 300, rank: int = RANK,
                        rope: int = ROPE):
    """The decode FLOPs formula, ``2 * heads * (k + v)`` per cached token (``mla_flops``),
    against what torch's FLOP counter (``torch.utils.flop_counter``) counts in the float64
    reference, ``paged_mla_attention_ref``, decoding one token over ``context`` cached ones."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.attention import paged_mla_attention_ref
    from labkit.lessons.mla.shapes import BLOCK, SCALE

    g = torch.Generator().manual_seed(0)
    blocks = -(-context // BLOCK)
    cache = torch.randn(blocks, BLOCK, rank + rope, dtype=torch.float64, generator=g)
    q_latent = torch.randn(1, heads, rank, dtype=torch.float64, generator=g)
    q_rope = torch.randn(1, heads, rope, dtype=torch.float64, generator=g)
    with FlopCounterMode(display=False) as counter:
        paged_mla_attention_ref(q_latent, q_rope, cache,
                                torch.arange(blocks, dtype=torch.int32)[None],
                                torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([context], dtype=torch.int32), scale=SCALE)
    counted, formula = counter.get_total_flops(), mla_flops(1, heads, context, rank, rope)
    return claim("torch's FLOP counter counted {c:,} FLOPs in the reference's decode of one token "
                 "over {ctx} cached ones with {h} heads; 2 x heads x (k + v) per cached token, "
                 "with k = {k} and v = {v}, gives {f:,}.", counted == formula, c=counted,
                 ctx=context, h=heads, k=rank + rope, v=rank, f=formula)


def roof_us(nbytes: int, flops: int, copy_gbps: float, matmul_tflops: float) -> float:
    """The shortest time the two roofs allow: every byte at copy speed, or every FLOP at matmul
    speed, whichever takes longer."""
    return max(nbytes / (copy_gbps * 1e3), flops / (matmul_tflops * 1e6))


def bytes_claims(table: pd.DataFrame, cache_gib: float, context: int) -> list:
    gqa, mla = table.iloc[1], table.iloc[-1]
    return [
        claim("Per token MLA caches {mla:.1f} KiB across the layers against {gqa:.1f} KiB for "
              "GQA with 8 KV heads: {ratio:.1f}x fewer bytes, so {gib:g} GiB holds {n_mla} "
              "requests of {ctx} tokens instead of {n_gqa}.",
              mla["KiB per token"] < gqa["KiB per token"] and
              mla["requests that fit"] > gqa["requests that fit"],
              mla=mla["KiB per token"], gqa=gqa["KiB per token"],
              ratio=gqa["KiB per token"] / mla["KiB per token"], gib=cache_gib,
              n_mla=mla["requests that fit"], ctx=context, n_gqa=gqa["requests that fit"]),
        claim("MQA, one KV head of {k} + {v} values, caches {mqa:.2f}x MLA's bytes: fewer, but "
              "every head then reads the same key and value, where MLA's heads each up-project "
              "their own from the {rank}-wide latent (W_UK and W_UV per head).",
              table.iloc[2]["KiB per token"] < mla["KiB per token"] < gqa["KiB per token"],
              k=DEEPSEEK_V3.k_head_dim, v=DEEPSEEK_V3.v_head_dim,
              mqa=table.iloc[2]["bytes vs MLA"], rank=DEEPSEEK_V3.kv_lora_rank),
    ]


def per_byte_claim(table: pd.DataFrame):
    """Each scheme's decode FLOPs per cached byte: the more heads share a cached row, the more
    work each byte feeds."""
    f = table["FLOPs per cached byte (decode)"].tolist()
    return claim("A decode step does {mha:.0f} FLOP per cached byte under MHA (each head reads "
                 "its own K and V, bf16), {gqa:.0f} under GQA with 8 KV heads, {mqa:.0f} under "
                 "MQA and {mla:.0f} under MLA with 128 heads: each byte feeds as many heads as "
                 "share it.", f == sorted(f) and len(set(f)) == len(f), mha=f[0], gqa=f[1],
                 mqa=f[2], mla=f[3])


def intensity_claim(table: pd.DataFrame, ridge: float, recorded=None):
    """Where each scheme's decode sits against the ridge (matmul FLOP/s over copy bytes/s)."""
    mla = float(table.iloc[-1]["FLOPs per cached byte (decode)"])
    gqa = float(table.iloc[1]["FLOPs per cached byte (decode)"])
    return claim("At 128 heads an MLA decode does {mla:.0f} FLOPs per cached byte, above the "
                 "ridge of {ridge:.0f} (bf16 matmul over copy bandwidth): compute, not memory, "
                 "bounds it, where GQA's {gqa:.0f} sits far below the ridge.",
                 gqa < ridge < mla, mla=mla, ridge=ridge, gqa=gqa, recorded=recorded)


def intensity_figure(ridge: float, where: str, dims: AttentionDims = DEEPSEEK_V3):
    """FLOPs per cached byte of a decode step: each scheme at the model's 128 heads, and MLA at
    fewer heads, against the ridge (log scale)."""
    import plotly.graph_objects as go
    h = dims.num_attention_heads
    bars = {f"MHA {h}/{h}": decode_intensity(dims, "MHA", kv_heads=h),
            f"GQA {h}/8": decode_intensity(dims, "MHA", kv_heads=8),
            f"MQA {h}/1": decode_intensity(dims, "MHA", kv_heads=1)}
    for heads in (16, 32, 64, 128):
        bars[f"MLA {heads} heads"] = decode_intensity(dims, "MLA", heads=heads)
    fig = go.Figure(go.Bar(x=list(bars), y=list(bars.values()),
                           marker_color=["#888"] * 3 + ["#c44"] * 4,
                           text=[f"{v:.0f}" for v in bars.values()], textposition="outside"))
    fig.add_hline(y=ridge, line_dash="dash",
                  annotation_text=f"ridge {ridge:.0f} FLOPs/byte ({where})")
    fig.update_layout(title="A decode step's FLOPs per byte of KV cache read (bf16)",
                      yaxis_type="log", yaxis_title="FLOPs per cached byte", height=420)
    return fig
