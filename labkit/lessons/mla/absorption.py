"""Weight absorption: attention over the latent itself, checked on a layer's own weights, and
what decompressing every step would cost instead (notebook 10, section 2)."""
from __future__ import annotations

import pandas as pd
import torch

from labkit.lessons.mla.cache_bytes import mla_flops
from labkit.lessons.paged_kv_cache.attention_memory import DEEPSEEK_V3, AttentionDims
from labkit.teaching import claim


def absorption_check(attention, tokens: int = 7, seed: int = 0) -> dict:
    """Attention of ``tokens`` queries over as many cached latents, computed both ways with the
    layer's own ``W_UK``/``W_UV`` (``MLAAttention.up_projections``), in float64.

    decompressed: per head k = [W_UK c_kv ; k_pe], v = W_UV c_kv, then softmax(q.k) v;
    absorbed: q_latent = W_UK^T q_nope, softmax(q_latent.c_kv + q_pe.k_pe) c_kv, then W_UV.
    Returns the largest difference of the scores and of the outputs, and the tensors' shapes."""
    w_uk, w_uv = (w.detach().double().cpu() for w in attention.up_projections())  # algebra: CPU
    heads, nope, rank = w_uk.shape
    rope = attention.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(tokens, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(tokens, heads, rope, generator=g, dtype=torch.float64)
    c_kv = torch.randn(tokens, rank, generator=g, dtype=torch.float64)
    k_pe = torch.randn(tokens, rope, generator=g, dtype=torch.float64)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    scale = attention.scale

    k_nope = torch.einsum("hnr,sr->shn", w_uk, c_kv)               # [S, H, nope] per head
    v = torch.einsum("hvr,sr->shv", w_uv, c_kv)                     # [S, H, v]
    s_dec = (torch.einsum("thn,shn->hts", q_nope, k_nope)
             + torch.einsum("thp,sp->hts", q_pe, k_pe)) * scale
    p_dec = torch.softmax(s_dec.masked_fill(~mask, float("-inf")), -1)
    out_dec = torch.einsum("hts,shv->thv", p_dec, v)

    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)           # W_UK folded into q
    s_abs = (torch.einsum("thr,sr->hts", q_latent, c_kv)
             + torch.einsum("thp,sp->hts", q_pe, k_pe)) * scale
    p_abs = torch.softmax(s_abs.masked_fill(~mask, float("-inf")), -1)
    out_abs = torch.einsum("thr,hvr->thv", torch.einsum("hts,sr->thr", p_abs, c_kv), w_uv)
    return {"score_diff": float((s_dec - s_abs).abs().max()),
            "output_diff": float((out_dec - out_abs).abs().max()),
            "output_scale": float(out_dec.abs().max()), "heads": heads, "nope": nope,
            "rank": rank, "rope": rope, "tokens": tokens}


def decode_step_flops(dims: AttentionDims = DEEPSEEK_V3, context: int = 4096) -> pd.DataFrame:
    """Per layer and decode step of one sequence at ``context`` tokens: the FLOPs of each way to
    attend. Decompressing re-derives every cached token's per-head keys and values from its latent
    (``context x heads x (nope + v) x rank`` multiply-adds) before attending over them; absorbing
    folds W_UK into the one new query and W_UV into its output and attends over the latent."""
    h, n, v, r, p = (dims.num_attention_heads, dims.qk_nope_head_dim, dims.v_head_dim,
                     dims.kv_lora_rank, dims.qk_rope_head_dim)
    decompress = 2 * context * h * (n + v) * r
    attend_heads = 2 * context * h * ((n + p) + v)
    fold = 2 * h * (n + v) * r  # W_UK into the query, W_UV into the output: one token's worth
    attend_latent = mla_flops(1, h, context, r, p)
    return pd.DataFrame([
        {"path": "decompressed", "up-projections": decompress, "attention": attend_heads,
         "total GFLOP": (decompress + attend_heads) / 1e9},
        {"path": "absorbed", "up-projections": fold, "attention": attend_latent,
         "total GFLOP": (fold + attend_latent) / 1e9}]).set_index("path")


def absorption_claims(check: dict, flops: pd.DataFrame, context: int) -> list:
    ratio = flops.loc["decompressed", "total GFLOP"] / flops.loc["absorbed", "total GFLOP"]
    return [
        claim("Folding W_UK into the query gives the same scores as up-projecting every key "
              "(largest difference {s:.1e}) and applying W_UV after attention the same outputs "
              "({o:.1e}, on outputs up to {scale:.1f}): associativity, in float64.",
              check["score_diff"] < 1e-10 and check["output_diff"] < 1e-10 * max(
                  1.0, check["output_scale"]), s=check["score_diff"],
              o=check["output_diff"], scale=check["output_scale"]),
        claim("For one decode step at {ctx} tokens of context, a DeepSeek-V3 layer that "
              "decompressed its cache would do {ratio:.0f}x the FLOPs of the absorbed path: it "
              "re-derives every cached token's keys and values for all heads.",
              ratio > 10, ctx=context, ratio=ratio),
    ]
